"""Hugging Face experts through tessel's grouped GEMM (``experts_implementation="tessel"``) and in fp8.

Each family's tiny model (random init, no downloads) runs its experts with transformers' loop (``eager``) and with
tessel's implementation: the logits and every parameter's gradient agree at tests/layers/test_hf.py's tolerance
(fp32, 1e-4 relative). Layouts covered: Mixtral (``[gate; up]`` halves, ``[E, out, in]``), GPT-OSS (interleaved
gate/up with its own clamped gate, transposed ``[E, in, out]``, biases), Qwen2-MoE (a shared expert beside),
DeepSeek-V3 (group-limited routing), and up/down experts without a gate. Expert parallelism's sentinel routes are
checked against transformers' ``grouped_mm``; fp8 against the float64 product of the quantised operands.
"""

import copy

import pytest
import torch
from torch import nn

import tessel.layers.hf_grouped_experts as grouped_experts
from tessel.kernels import quantize_fp8_reference
from tessel.layers import convert_to_fp8, fp8_layers
from tessel.layers.hf_grouped_experts import register_hf_experts, tessel_experts_forward
from tests.layers.test_hf import REFERENCE_KERNELS, _batch, _close, _forward_backward, needs_hf
from tests.layers.test_hf_experts import _moe, _UpDownExperts
from tests.multiprocess import run_ranks

pytestmark = needs_hf


def _counting(monkeypatch) -> list:
    """Counts the grouped GEMMs tessel's implementation launches (so a test knows it ran, not transformers' own)."""
    calls, grouped = [], grouped_experts.grouped_matmul

    def spy(*args):
        calls.append(args[0].shape[0])
        return grouped(*args)

    monkeypatch.setattr(grouped_experts, "grouped_matmul", spy)
    return calls


def _against_eager(model, tag):
    """``model`` with transformers' loop and with tessel's implementation: logits and every gradient."""
    ids, weights = _batch()
    model.set_experts_implementation("eager")
    want = _forward_backward(model, ids, weights)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    mine = copy.deepcopy(model)
    mine.zero_grad(set_to_none=True)
    mine.set_experts_implementation(register_hf_experts())
    assert mine.config._experts_implementation == "tessel"
    got = _forward_backward(mine, ids, weights)
    _close(got, want, msg=lambda m: f"{tag} logits: {m}")
    for name, p in mine.named_parameters():
        if name in grads:
            _close(p.grad, grads[name], msg=lambda m, name=name: f"{tag} grad of {name}: {m}")
        else:
            assert p.grad is None, f"{tag} {name}"


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "qwen2_moe", "deepseek_v3"])
def test_matches_transformers_loop(family, monkeypatch):
    calls = _counting(monkeypatch)
    _against_eager(_moe(family), family)
    assert calls, "tessel's implementation never ran"


class _Config:
    _experts_implementation = "eager"


def _up_down_experts():
    """test_hf_experts' experts without a gate (``down(relu(up(x)))``, with biases), decorated as transformers
    decorates its own experts classes (``has_gate=False``: its ``act_fn`` runs between the projections)."""
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(has_gate=False, has_bias=True)
    class UpDownExperts(_UpDownExperts):
        def __init__(self, config):
            super().__init__(hidden=24, inter=32)
            self.act_fn = nn.ReLU()

    torch.manual_seed(0)
    return UpDownExperts(_Config())


def _routes(tokens=13, experts=4, k=2, seed=3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    return ids, torch.softmax(torch.randn(tokens, k, generator=gen), -1)


def test_experts_without_a_gate_and_with_biases(monkeypatch):
    calls = _counting(monkeypatch)
    module = _up_down_experts()
    x = torch.randn(13, 24, requires_grad=True)
    ids, w = _routes()
    w.requires_grad_()
    want = module(x, ids, w)  # the module's own loop
    gy = torch.randn_like(want)
    want.backward(gy)
    expected = [t.grad.clone() for t in (x, w, *module.parameters())]
    for t in (x, w, *module.parameters()):
        t.grad = None
    got = tessel_experts_forward(module, x, ids, w)
    got.backward(gy)
    assert calls == [26, 26]  # two projections, 13 tokens x 2 routes each
    _close(got, want)
    for g, e in zip((x.grad, w.grad, *(p.grad for p in module.parameters())), expected, strict=True):
        _close(g, e)


def test_sentinel_routes_of_expert_parallelism_contribute_nothing(monkeypatch):
    """Routes to experts another rank holds carry the id ``num_experts``: as transformers' grouped_mm implementation
    does, they add nothing to the output and send no gradient. The grouped GEMM never writes their rows: here they
    hold NaN, which the implementation must mask out."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    grouped = grouped_experts.grouped_matmul

    def poisoned(a, b, offsets):
        out = grouped(a, b, offsets)
        end = int(offsets[-1])
        return torch.cat((out[:end], torch.full_like(out[end:], float("nan"))))

    monkeypatch.setattr(grouped_experts, "grouped_matmul", poisoned)

    experts = _moe("mixtral").model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    x = torch.randn(13, 64, requires_grad=True)
    ids, w = _routes()
    ids[::3, 1] = experts.num_experts  # every third token's second route goes elsewhere
    w = w.masked_fill(ids == experts.num_experts, 0.0).requires_grad_()
    gy = torch.randn(13, 64)
    results = []
    for forward in (grouped_mm_experts_forward, tessel_experts_forward):
        y = forward(experts, x, ids, w)
        y.backward(gy)
        results.append((y.detach(), x.grad.clone(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
        x.grad = experts.gate_up_proj.grad = experts.down_proj.grad = w.grad = None
    for got, want in zip(*results, strict=True):
        assert torch.isfinite(got).all()
        _close(got, want)


@pytest.mark.gpu
def test_forward_on_cuda_never_synchronises_the_host():
    """Sorting the routes, each expert's first row (a binary search, where torch.bincount would read the ids on
    the host) and the grouped GEMMs, under ``torch.cuda.set_sync_debug_mode("error")``, after a first call that
    autotunes the GEMMs."""
    experts = _moe("mixtral").model.layers[0].mlp.experts.cuda()
    x = torch.randn(13, 64, device="cuda")
    ids, w = (t.cuda() for t in _routes())
    tessel_experts_forward(experts, x, ids, w)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tessel_experts_forward(experts, x, ids, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _emulated_fp8(x, weight, offsets):
    """fp8_grouped_linear's forward in float64: x in e4m3 with one scale, each expert's weight with its own."""
    qx = quantize_fp8_reference(x, "e4m3")
    xq = qx.data.double() * qx.scale_inv.double()
    qw = quantize_fp8_reference(weight, "e4m3")
    wq = qw.data.double() * qw.scale_inv.double().view(-1, 1, 1)
    out = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.float64)
    bounds = offsets.tolist()
    for e in range(weight.shape[0]):
        out[bounds[e] : bounds[e + 1]] = xq[bounds[e] : bounds[e + 1]] @ wq[e].t()
    return out.to(x.dtype)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_convert_to_fp8_runs_hugging_face_experts_in_fp8(family, monkeypatch):
    """convert_to_fp8 turns on fp8 in every experts module (and names tessel's implementation in the model's
    config); each projection is then the float64 product of its quantised operands (the fp8 GEMM replaced by
    that product gives the same logits to fp32 rounding), close to the unquantised model but not equal to it."""
    dense = _moe(family)
    dense.set_experts_implementation("eager")
    model = convert_to_fp8(copy.deepcopy(dense))
    experts = [name for name, m in model.named_modules() if name.endswith("mlp.experts")]
    assert experts and set(experts) <= set(fp8_layers(model))
    assert model.config._experts_implementation == "tessel"
    ids, weights = _batch()
    got = _forward_backward(model, ids, weights)
    assert all(model.get_submodule(name).gate_up_proj.grad is not None for name in experts)
    want = _forward_backward(dense, ids, weights)
    rel = ((got - want).norm() / want.norm()).item()
    assert 1e-5 < rel < 0.2, rel  # fp8's rounding, not the unquantised result
    monkeypatch.setattr(grouped_experts, "fp8_grouped_linear", _emulated_fp8)
    with torch.no_grad():
        emulated = model(ids).logits
    _close(got, emulated)


def test_experts_of_odd_widths_stay_as_they_are():
    model = _moe("mixtral", intermediate_size=40)  # 40 features: not a multiple of 16
    convert_to_fp8(model)
    assert not [name for name in fp8_layers(model) if name.endswith("experts")]


def _tensor_parallel(rank, world_size):
    """Split by features and by whole experts over two ranks, the parallel model running tessel's implementation
    (sentinel routes included when split by experts) against the dense model running transformers' loop."""
    from tessel.layers.parallelize import parallelize
    from tests.layers.test_hf import _check_against_dense

    for split in ("features", "experts"):
        dense = _moe("qwen2_moe")
        dense.set_experts_implementation("eager")
        par = parallelize(copy.deepcopy(dense), None, expert_split=split)
        par.set_experts_implementation(register_hf_experts())
        _check_against_dense(dense, par, f"split by {split}")
    return "ok"


def test_tensor_and_expert_parallel_models_run_it():
    assert run_ranks(_tensor_parallel, 2, timeout=400, env=REFERENCE_KERNELS) == ["ok", "ok"]

"""linear_cross_entropy against float64 F.cross_entropy(hidden @ W.T + b), in one process and on 2 and 4 ranks.

The reference rounds the inputs to the tested dtype first, then computes in float64. Tolerances: the loss is
fp32 throughout (fp32 logits from the GEMM, log-sum-exp, merge across ranks): 1e-5 relative. Gradients: the
logits' gradient is rounded to the inputs' dtype before the two GEMMs (as the unfused head's backward does),
so fp16 adds half an ulp (2⁻¹¹) per element of a sum of ~V terms: 1e-2 relative to the largest element,
fp32 1e-5.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tessel.bench.loss import LargestTensor
from tessel.layers.linear_cross_entropy import default_chunk_size, linear_cross_entropy
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

B, S, E, V = 2, 12, 11, 36  # S and V divisible by 2 and 4; 24 tokens (not a multiple of the chunks tried)
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 1e-2}


def _data(dtype, ignore_index=-100, seed=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, E, generator=g).to(dtype)
    weight = (torch.randn(V, E, generator=g) / E**0.5).to(dtype)
    bias = torch.randn(V, generator=g).to(dtype)
    target = torch.randint(0, V, (B, S), generator=g)
    target[0, :2] = ignore_index
    target[1, 0], target[1, 1] = 0, V - 1  # the first and last vocab entries: the first and the last rank's
    return hidden, weight, bias, target


def reference_loss(logits, target, reduction, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """torch's cross entropy (with its label smoothing) plus PaLM's z-loss c·lse² per counted token, reduced, of the
    logits soft-capped first with ``softcap``."""
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    flat, tgt = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    per_token = F.cross_entropy(flat, tgt, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid = tgt != ignore_index
    per_token = per_token + z_loss * torch.logsumexp(flat, dim=-1).square() * valid
    if reduction == "none":
        return per_token.view(target.shape)
    return per_token.sum() if reduction == "sum" else per_token.sum() / valid.sum()


def _reference(hidden, weight, bias, target, reduction, grad_loss, ignore_index=-100, **options):
    x, w, b = (t.double().requires_grad_() for t in (hidden, weight, bias))
    loss = reference_loss(x @ w.t() + b, target, reduction, ignore_index, **options)
    loss.backward(grad_loss)
    return loss.detach(), x.grad, w.grad, b.grad


def _grad_loss(reduction):
    g = torch.Generator().manual_seed(9)
    if reduction == "none":
        return torch.rand(B, S, generator=g, dtype=torch.float64) + 0.5
    return torch.tensor(1.7, dtype=torch.float64)


def _close(actual, expected, dtype, what):
    assert actual.dtype == dtype, what
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=GRAD_RTOL[dtype] * scale,
                               msg=lambda m: f"{what}: {m}")  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [5, None])
def test_matches_the_head_and_cross_entropy(dtype, reduction, chunk_size):
    hidden, weight, bias, target = _data(dtype)
    grad_loss = _grad_loss(reduction)
    ref = _reference(hidden, weight, bias, target, reduction, grad_loss)
    x, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    loss = linear_cross_entropy(x, w, target, bias=b, reduction=reduction, chunk_size=chunk_size)
    assert loss.dtype == torch.float32 and loss.shape == ref[0].shape
    torch.testing.assert_close(loss.double(), ref[0], rtol=1e-5, atol=1e-6)
    loss.backward(grad_loss.float())
    for name, t, expected in (("hidden", x, ref[1]), ("weight", w, ref[2]), ("bias", b, ref[3])):
        _close(t.grad, expected, dtype, f"{name} grad ({reduction}, chunk {chunk_size})")


@pytest.mark.parametrize("reduction, chunk_size", [("mean", 1), ("none", 100)])
def test_one_token_per_chunk_and_one_chunk_for_all(reduction, chunk_size):
    test_matches_the_head_and_cross_entropy(torch.float32, reduction, chunk_size)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(
    "label_smoothing, z_loss, softcap",
    [(0.1, 0.0, None), (0.0, 1e-2, None), (0.3, 1e-3, None), (1.0, 0.0, None), (0.0, 0.0, 0.5), (0.1, 1e-3, 2.0)],
)
def test_label_smoothing_z_loss_and_soft_capped_logits(reduction, label_smoothing, z_loss, softcap):
    hidden, weight, bias, target = _data(torch.float32)
    options = dict(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    grad_loss = _grad_loss(reduction)
    ref = _reference(hidden, weight, bias, target, reduction, grad_loss, **options)
    x, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    loss = linear_cross_entropy(x, w, target, bias=b, reduction=reduction, chunk_size=5, **options)
    torch.testing.assert_close(loss.double(), ref[0], rtol=1e-5, atol=1e-6)
    loss.backward(grad_loss.float())
    for name, t, expected in (("hidden", x, ref[1]), ("weight", w, ref[2]), ("bias", b, ref[3])):
        _close(t.grad, expected, torch.float32, f"{name} grad ({options})")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_only_what_needs_a_gradient_gets_one(reduction):
    hidden, weight, _, target = _data(torch.float32)
    grad_loss = _grad_loss(reduction)
    ref = _reference(hidden, weight, torch.zeros(V), target, reduction, grad_loss)
    w = weight.clone().requires_grad_()
    loss = linear_cross_entropy(hidden, w, target, reduction=reduction, chunk_size=4)
    loss.backward(grad_loss.float())
    _close(w.grad, ref[2], torch.float32, "weight grad")
    x = hidden.clone().requires_grad_()
    linear_cross_entropy(x, weight, target, reduction=reduction, chunk_size=4).backward(grad_loss.float())
    _close(x.grad, ref[1], torch.float32, "hidden grad")
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(x, w, target, reduction=reduction).double(), ref[0])


def test_ignored_targets_and_an_ignore_index_inside_the_vocabulary():
    hidden, weight, bias, target = _data(torch.float32, ignore_index=V // 2)
    ref = _reference(hidden, weight, bias, target, "mean", _grad_loss("mean"), ignore_index=V // 2)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(x, w, target, bias=bias, ignore_index=V // 2, chunk_size=3)
    loss.backward(_grad_loss("mean").float())
    torch.testing.assert_close(loss.double(), ref[0])
    _close(x.grad, ref[1], torch.float32, "hidden grad")
    _close(w.grad, ref[2], torch.float32, "weight grad")
    # Every target ignored: "mean" is 0/0 = nan, as in torch, and every gradient is zero.
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(x, w, torch.full((B, S), -100))
    loss.backward()
    assert torch.isnan(loss) and not x.grad.any() and not w.grad.any()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_tensor_holds_the_logits(reduction):
    """Forward and backward create nothing larger than one chunk of logits, the hidden states or the weight,
    where the unfused head and loss create [N, V] tensors."""
    n, e, v, chunk = 64, 8, 200, 8  # N·V = 12800 elements; chunk·V = W = 1600, N·E = 512
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, e, generator=g, requires_grad=True)
    w = torch.randn(v, e, generator=g, requires_grad=True)
    target = torch.randint(0, v, (n,), generator=g)
    with LargestTensor() as fused:
        linear_cross_entropy(x, w, target, reduction=reduction, chunk_size=chunk).sum().backward()
    with LargestTensor() as unfused:
        F.cross_entropy(x @ w.t(), target, reduction=reduction).sum().backward()
    assert unfused.largest >= n * v * 4  # the check sees the (fp32) logits where they exist
    assert fused.largest <= max(chunk * v, n * e, v * e) * 4, fused.largest


def test_default_chunk_size():
    assert default_chunk_size(16384, 16032, 4096) == 4096  # Llama 3 at tp 8: four chunks of fp32 logits
    assert default_chunk_size(16384, 128256, 4096) == 2048  # tp 1: 32 chunks by the size rule, 8 of 2048 tokens
    assert default_chunk_size(16384, 50304, 2048) == 2048  # GPT-2's vocabulary (the training job's 1B preset)
    assert default_chunk_size(100, 50, 64) == 100  # one chunk
    assert default_chunk_size(3000, 50, 64) == 3000  # logits smaller than the hidden states: one chunk
    assert default_chunk_size(0, 50, 64) == 1


def test_compiles_whole():
    hidden, weight, bias, target = _data(torch.float32)
    for reduction in ("mean", "none"):
        fn = lambda x, w, b, r=reduction: linear_cross_entropy(x, w, target, bias=b, reduction=r, chunk_size=5).sum()
        results = []
        for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            x, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
            loss = run(x, w, b)
            loss.backward()
            results.append((loss.detach(), x.grad, w.grad, b.grad))
        for eager, compiled in zip(*results):
            torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(hidden=[1.0]), TypeError, "hidden must be a torch.Tensor, received list"),
        (dict(hidden=torch.ones(2, 3, E, dtype=torch.float64)), TypeError, "hidden must be float32"),
        (dict(weight=torch.ones(V, E + 1)), ValueError, r"weight must be \[V/t, 11\]"),
        (dict(weight=torch.ones(V, E, dtype=torch.float16)), ValueError, "weight must be torch.float32"),
        (dict(bias=torch.ones(V + 1)), ValueError, r"bias must be None or a \(36,\) torch.float32 tensor"),
        (dict(target=torch.zeros(B, S + 1, dtype=torch.long)), ValueError, r"target must have shape \(2, 12\)"),
        (dict(target=torch.zeros(B, S)), TypeError, "target must be an integer tensor"),
        (dict(target=torch.full((B, S), V)), ValueError, r"target must lie in \[0, 36\)"),
        (dict(reduction="avg"), ValueError, "reduction must be one of"),
        (dict(ignore_index=1.0), TypeError, "ignore_index must be an int"),
        (dict(chunk_size=0), ValueError, "chunk_size must be None or a positive int, received 0"),
        (dict(chunk_size=True), ValueError, "chunk_size must be None or a positive int, received True"),
        (dict(sequence_parallel=1), TypeError, "sequence_parallel must be a bool"),
        (dict(label_smoothing=1.5), ValueError, r"label_smoothing must lie in \[0, 1\], received 1.5"),
        (dict(label_smoothing="0.1"), TypeError, "label_smoothing must be a float, received str"),
        (dict(z_loss=-1e-4), ValueError, "z_loss must be a finite number >= 0, received -0.0001"),
        (dict(softcap=0.0), ValueError, "softcap must be None or a finite number above 0, received 0.0"),
        (dict(softcap="30"), TypeError, "linear_cross_entropy: softcap must be None or a float, received str"),
        (dict(hidden=torch.ones(S, E), sequence_parallel=True), ValueError, r"hidden must be \[B, S/t, E\]"),
    ],
)
def test_bad_input_is_refused(kwargs, error, match):
    hidden, weight, bias, target = _data(torch.float32)
    args = dict(hidden=hidden, weight=weight, target=target, bias=bias)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        linear_cross_entropy(args.pop("hidden"), args.pop("weight"), args.pop("target"), **args)


# ---------------------------------------------------------------------------------------------------- several ranks


def _ranks_worker(rank, t):
    from tessel.parallel.comm import count_bytes

    smooth = dict(label_smoothing=0.1, z_loss=1e-2)
    cases = [(torch.float32, "mean", False, 3, {}), (torch.float32, "none", True, 5, {}),
             (torch.float32, "sum", True, None, {}), (torch.float16, "mean", True, 4, {}),
             (torch.float32, "mean", True, 5, smooth), (torch.float32, "none", False, 7, smooth),
             (torch.float32, "mean", False, 5, {**smooth, "softcap": 0.5})]  # fmt: skip
    for dtype, reduction, sp, chunk, options in cases:
        hidden, weight, bias, target = _data(dtype)
        grad_loss = _grad_loss(reduction)
        ref = _reference(hidden, weight, bias, target, reduction, grad_loss, **options)
        rows, seq = slice(rank * V // t, (rank + 1) * V // t), slice(rank * S // t, (rank + 1) * S // t)
        x = hidden[:, seq] if sp else hidden
        x = x.clone().requires_grad_()
        w, b = weight[rows].clone().requires_grad_(), bias[rows].clone().requires_grad_()
        with count_bytes() as sent:
            loss = linear_cross_entropy(x, w, target, bias=b, reduction=reduction, chunk_size=chunk,
                                        sequence_parallel=sp, **options)  # fmt: skip
        tag = f"tp={t} {dtype} {reduction} sp={sp} chunk={chunk} {options}"
        torch.testing.assert_close(
            loss.double(), ref[0], rtol=1e-5, atol=1e-6, msg=lambda m, tag=tag: f"{tag} loss: {m}"
        )
        gathered = (t - 1) * B * S * E * x.element_size() // t if sp else 0
        per_token = 3 if options.get("label_smoothing") else 2  # (lse, z), and the sum of the logits to smooth
        assert sent.sent == gathered + (t - 1) * per_token * B * S * 4, tag  # the input's gather, then the stats
        loss.backward(grad_loss.float())
        _close(x.grad, ref[1][:, seq] if sp else ref[1], dtype, f"{tag} hidden grad")
        _close(w.grad, ref[2][rows], dtype, f"{tag} weight grad")
        _close(b.grad, ref[3][rows], dtype, f"{tag} bias grad")
    meta = [tensor.to("meta") for tensor in _data(torch.float32)]
    with pytest.raises(ValueError, match="the gloo tensor-parallel group needs cpu tensors, received hidden on meta"):
        linear_cross_entropy(meta[0], meta[1][: V // t], meta[3])
    return "ok"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_the_dense_head(world):
    assert run_ranks(_ranks_worker, world, timeout=180) == ["ok"] * world


# ---------------------------------------------------------------------------------------------------- the GPT


def _loss_and_grads(model, loss_of):
    model.zero_grad()
    loss = loss_of(model)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _gpt_worker(rank, t):
    from tessel.layers.gpt import GPT, GPTConfig
    from tessel.layers.linear_cross_entropy import linear_cross_entropy as fused

    cfg = GPTConfig(vocab_size=40, n_layer=1, n_head=4, n_kv_head=2, n_embd=64, block_size=16)
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(40, (2, 12), generator=g), torch.randint(40, (2, 12), generator=g)
    targets[0, 3] = -100
    import tessel.layers.gpt as gpt_module

    calls = []
    gpt_module.linear_cross_entropy = lambda *a, **k: (calls.append(k), fused(*a, **k))[1]
    for sp in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg, tp_group=None, sequence_parallel=sp)
        calls.clear()
        logits_path = _loss_and_grads(model, lambda m: m.loss_from_logits(m(idx), targets))
        assert calls == [], calls  # the logits path never calls it
        fused_path = _loss_and_grads(model, lambda m: m.loss(idx, targets))
        assert calls == [dict(bias=None, sequence_parallel=sp, label_smoothing=0.0, z_loss=0.0)], calls
        torch.testing.assert_close(fused_path[0], logits_path[0], rtol=1e-5, atol=1e-6)
        for name, want in logits_path[1].items():
            msg = lambda m, name=name, sp=sp: f"sp={sp} {name}: {m}"
            torch.testing.assert_close(fused_path[1][name], want, rtol=1e-4, atol=1e-6, msg=msg)
    return "ok"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_gpt_loss_runs_the_fused_head_and_matches_the_logits_path(world):
    """GPT.loss (through GPT.forward(idx, targets=...)) gives the loss and every gradient of the logits path."""
    assert run_ranks(_gpt_worker, world, timeout=180, env=REFERENCE_KERNELS) == ["ok"] * world


def _hf_worker(rank, t):
    import transformers

    from tessel.layers import parallelize

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(config)
    split = transformers.LlamaForCausalLM(config)
    split.load_state_dict(dense.state_dict())
    parallelize(split, None, sequence_parallel=True)
    ids = torch.randint(96, (2, 8), generator=torch.Generator().manual_seed(4))
    reference = dense(ids, labels=ids).loss  # Hugging Face's own loss: the logits, shifted by one
    reference.backward()
    hidden = split.model(ids).last_hidden_state
    loss = linear_cross_entropy(hidden[:, :-1], split.lm_head.weight, ids[:, 1:], None)
    loss.backward()
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-5, atol=1e-6)
    rows = slice(rank * 96 // t, (rank + 1) * 96 // t)
    for name in ("lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"):
        want = dict(dense.named_parameters())[name].grad
        got = dict(split.named_parameters())[name].grad
        want = want[rows] if name != "model.norm.weight" and got.shape != want.shape else want
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}")
    return "ok"


@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_a_parallelized_hugging_face_model_trains_through_it():
    """A Llama split over 2 ranks with sequence parallelism: its last hidden state and its (column-split) lm head
    give Hugging Face's own loss of the dense model, and the dense model's gradients."""
    assert run_ranks(_hf_worker, 2, timeout=180, env=REFERENCE_KERNELS) == ["ok", "ok"]


@pytest.mark.gpu
def test_on_cuda_it_matches_and_holds_a_fraction_of_the_memory():
    """bf16 on a GPU, a Llama-sized vocabulary: the compiled GEMMs give the float64 loss and gradients, and the
    peak memory above the inputs is a fraction of the unfused head and loss's ([N, V] bf16 logits, their fp32
    copy and their gradient)."""
    n, e, v = 4096, 512, 32000
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, e, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, e, device="cuda", generator=g) / e**0.5).bfloat16().requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    peaks, results = [], []
    # 512-token chunks: fp32 logits 64 MiB, beside the fp32 dW (62 MiB) and the bf16 gradients; unfused: the
    # [4096, 32000] logits in bf16, their fp32 copy and their fp32 gradient, 1.2 GiB at least.
    fused = lambda: linear_cross_entropy(x, w, target, chunk_size=512)
    for run in (fused, lambda: F.cross_entropy((x @ w.t()).float(), target)):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = run()
        loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        results.append((loss.detach(), x.grad, w.grad))
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(xd @ wd.t(), target)
    ref.backward()
    torch.testing.assert_close(results[0][0].double(), ref.detach(), rtol=1e-4, atol=1e-4)
    for got, want, name in ((results[0][1], xd.grad, "hidden"), (results[0][2], wd.grad, "weight")):
        scale = want.abs().max().item()
        msg = lambda m, name=name: f"{name}: {m}"
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2 * scale, msg=msg)
    unfused_logits = n * v * (2 + 4 + 4)  # bf16 logits, their fp32 copy, the fp32 gradient
    assert peaks[1] >= unfused_logits, peaks
    assert peaks[0] < peaks[1] / 4, peaks


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_no_tokens(reduction):
    """An empty batch: a zero (or empty) loss and zero gradients, as torch gives."""
    x = torch.randn(0, E, requires_grad=True)
    w = torch.randn(V, E, requires_grad=True)
    loss = linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.long), reduction=reduction)
    assert loss.shape == (() if reduction == "sum" else (0,))
    loss.sum().backward()
    assert x.grad.shape == (0, E) and w.grad.shape == (V, E) and not w.grad.any()


def test_the_last_pipeline_stage_returns_hidden_states_and_their_loss():
    """``pipeline_stage(fused_loss=True)``: the last stage hands the schedule its final norm's output, and
    ``GPTStage.loss`` gives the whole model's loss and gradients from it (one process, two stages in a row)."""
    from tessel.layers.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=40, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=16)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(40, (2, 12), generator=g), torch.randint(40, (2, 12), generator=g)
    gpt.loss_from_logits(gpt(idx), targets).backward()
    want = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    gpt.zero_grad()
    first, last = gpt.pipeline_stage(0, 2), gpt.pipeline_stage(1, 2, fused_loss=True)
    hidden = last(first(idx))
    assert hidden.shape == (2, 12, 64)  # the final norm's output, not logits
    last.loss(hidden, targets).backward()
    for name, grad in want.items():
        msg = lambda m, name=name: f"{name}: {m}"
        torch.testing.assert_close(dict(gpt.named_parameters())[name].grad, grad, rtol=1e-4, atol=1e-6, msg=msg)
    with pytest.raises(ValueError, match="only the last stage holds the head"):
        first.loss(hidden, targets)
    with pytest.raises(TypeError, match="fused_loss must be a bool, received int"):
        gpt.pipeline_stage(1, 2, fused_loss=1)


def test_gpt_config_label_smoothing_and_logit_z_loss():
    """GPTConfig's loss options reach both of the GPT's loss paths, which give torch's label-smoothed cross
    entropy plus c·lse² of the model's logits (float64)."""
    from tessel.layers.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=40, n_layer=1, n_head=4, n_embd=64, block_size=16, label_smoothing=0.1,
                    logit_z_loss=1e-2)  # fmt: skip
    torch.manual_seed(0)
    gpt = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(40, (2, 12), generator=g), torch.randint(40, (2, 12), generator=g)
    with torch.no_grad():
        want = reference_loss(gpt(idx).double(), targets, "mean", label_smoothing=0.1, z_loss=1e-2)
        torch.testing.assert_close(gpt.loss(idx, targets).double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gpt.loss_from_logits(gpt(idx), targets).double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"GPTConfig: label_smoothing must lie in \[0, 1\], received 2"):
        GPTConfig(label_smoothing=2)
    with pytest.raises(TypeError, match="GPTConfig: logit_z_loss must be a float, received str"):
        GPTConfig(logit_z_loss="1e-4")

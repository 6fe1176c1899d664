"""tessel's GPT: dense semantics, pipeline stages, and tensor-parallel GPT against the dense model on every rank.

Tensor-parallel runs build the dense model on a process group of one rank and the parallel model on the
whole world from the same seed: initialisation is layout-independent, so both hold the same global
weights, and every logit, loss and gradient shard must agree.

Tolerances: fp32 throughout. The parallel model sums the row-parallel partial products across ranks
(a different summation order) and its cross entropy combines per-rank max/sum-exp: differences of a
few fp32 ulps that grow through the layers to ~1e-6 relative; checked at 1e-4 relative.

The two-rank tensor-parallel runs of the plain model go through the kernels in Triton's interpreter; the
variants (four ranks, recomputation, windows, GELU) and the recomputation test run the kernels' plain-PyTorch
references: they test how the model composes, and tests/kernels proves the kernels.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessel.layers.attention import ParallelAttention, check_heads
from tessel.layers.gpt import GPT, GPTConfig
from tessel.parallel.sharding import shard_like
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

TOL = dict(rtol=1e-4, atol=1e-5)


def _config(**kw):
    base = dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=16)
    return GPTConfig(**{**base, **kw})


def _batch(cfg, b=2, s=8, seed=7):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(cfg.vocab_size, (b, s + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


# ---------------------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(n_embd=40), "heads of a size in"),
        (dict(n_head=4, n_kv_head=3), "not a multiple"),
        (dict(mlp="relu"), "mlp must be one of"),
        (dict(norm="batchnorm"), "norm must be one of"),
        (dict(n_layer=0), "n_layer must be a positive int"),
    ],
)
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)


def test_config_deterministic_attention_must_be_a_bool():
    with pytest.raises(TypeError, match="deterministic_attention must be a bool, received 0"):
        _config(deterministic_attention=0)
    with pytest.raises(TypeError, match="ParallelAttention: deterministic must be a bool, received str"):
        ParallelAttention(64, 4, deterministic="no")


def test_atomic_attention_backward_gives_the_same_gradients(seed, attention_launches):
    """deterministic_attention=False reaches flash attention (the one-kernel backward runs, and only it)
    and changes gradients by the summation order of dQ only."""
    from tessel.kernels._dispatch import Backend, backend_for

    cfg = _config(n_embd=64, n_head=4, n_kv_head=2)
    models = {flag: GPT(_config(deterministic_attention=flag)) for flag in (True, False)}
    models[False].load_state_dict(models[True].state_dict())
    assert "deterministic=False" in repr(models[False].blocks[0].attn)
    dkdv, dq = "_flash_attention_bwd_dkdv_kernel", "_flash_attention_bwd_dq_kernel"
    expected = {True: [(dkdv, False), (dq, None)] * cfg.n_layer, False: [(dkdv, True)] * cfg.n_layer}
    idx, targets = _batch(cfg)
    grads = {}
    for flag, model in models.items():
        attention_launches.clear()
        model.loss(idx, targets).backward()
        if backend_for(idx.float()) != Backend.REFERENCE:  # the backward's launches, after the forward's
            assert [k for k in attention_launches if k[0] != "_flash_attention_fwd_kernel"] == expected[flag]
        grads[flag] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads[True].items():
        torch.testing.assert_close(grads[False][name], grad, **TOL)


def test_config_recompute_must_be_a_bool():
    with pytest.raises(TypeError, match="recompute must be a bool, received 'yes'"):
        _config(recompute="yes")


def _activation_bytes(model, idx, targets):
    """Bytes of the non-parameter tensors autograd saves for backward during one forward and loss.

    Inside a recomputed block the checkpoint's own saved-tensor hooks take over, so these hooks see only
    what is saved outside the blocks' computations, the blocks' inputs (which the checkpoint saves) among
    them."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(idx, targets)
    return loss, sum(seen.values())


@pytest.mark.parametrize("mlp, norm", [("swiglu", "rmsnorm"), ("gelu", "layernorm")])
def test_recompute_gives_the_same_gradients_and_holds_no_block_activations(seed, reference_kernels, mlp, norm):
    """Activation checkpointing changes what backward keeps, not what it computes: loss and every gradient
    are bit-equal to the plain model's, the kernels' recomputed forward being the same launches on the
    same inputs. With depth the saved activations grow by one [B, S, E] tensor per block (its input),
    where the plain model's grow by every block's intermediates."""
    results = {}
    for n_layer in (2, 4):
        for recompute in (False, True):
            cfg = _config(n_layer=n_layer, mlp=mlp, norm=norm, bias=norm == "layernorm", recompute=recompute)
            torch.manual_seed(0)
            model = GPT(cfg)
            idx, targets = _batch(cfg)
            loss, saved = _activation_bytes(model, idx, targets)
            loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            results[n_layer, recompute] = loss.detach(), grads, saved
    for n_layer in (2, 4):
        (plain_loss, plain_grads, _), (loss, grads, _) = results[n_layer, False], results[n_layer, True]
        assert torch.equal(loss, plain_loss)
        for name, grad in plain_grads.items():
            assert torch.equal(grads[name], grad), name
    block = 2 * 8 * 64 * 4  # one [B, S, E] fp32 activation
    plain_growth = results[4, False][2] - results[2, False][2]
    assert plain_growth >= 2 * 8 * block  # two more blocks, each saving 8+ activations of [B, S, E] or wider
    # Recomputed, a block keeps its input alone (saved by the checkpoint, outside the block's hooks).
    assert results[4, True][2] - results[2, True][2] == 2 * block
    assert results[2, True][2] < results[2, False][2]
    assert GPT(_config(recompute=True)).pipeline_stage(0, 2).recompute


def test_recompute_only_while_autograd_records(seed, monkeypatch):
    """Under no_grad (evaluation, generation) the blocks run plainly: nothing to recompute for."""
    import tessel.layers.gpt as gpt_module

    model = GPT(_config(recompute=True))
    idx, _ = _batch(model.config)
    calls, checkpoint = [], gpt_module.checkpoint
    monkeypatch.setattr(gpt_module, "checkpoint", lambda fn, *a, **k: calls.append(fn) or checkpoint(fn, *a, **k))
    with torch.no_grad():
        model(idx)
    assert calls == []
    model(idx)
    assert calls == list(model.blocks)


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="n_kv_head=3 is smaller than the tensor-parallel size 4; kv heads are"):
        check_heads("GPT", 6, 3, 4)  # 3 kv heads cannot be replicated evenly over 4 ranks
    with pytest.raises(ValueError, match="only when n_kv_head divides it and it divides n_head=4"):
        check_heads("GPT", 4, 1, 8)  # 4 query heads cannot split over 8 ranks
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 4"):
        check_heads("GPT", 12, 6, 4)
    check_heads("GPT", 8, 2, 4)  # each kv head replicated on two ranks
    check_heads("GPT", 8, 1, 8)


@pytest.mark.parametrize("mlp, norm", [("swiglu", "rmsnorm"), ("gelu", "layernorm")])
def test_dense_loss_is_cross_entropy_of_the_logits(seed, mlp, norm):
    cfg = _config(mlp=mlp, norm=norm, bias=norm == "layernorm")
    model = GPT(cfg)
    idx, targets = _batch(cfg)
    logits = model(idx)
    assert logits.shape == (2, 8, cfg.vocab_size)
    want = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    torch.testing.assert_close(model.loss(idx, targets), want)
    assert model.num_params() == sum(p.numel() for p in model.parameters())


def test_attention_is_causal(seed):
    cfg = _config()
    model = GPT(cfg)
    idx, _ = _batch(cfg)
    changed = idx.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % cfg.vocab_size
    torch.testing.assert_close(model(idx)[:, :5], model(changed)[:, :5])
    assert not torch.allclose(model(idx)[:, 5:], model(changed)[:, 5:])


def test_sliding_window_attention_sees_only_the_window(seed):
    """One block with sliding_window=3: the logits at position i depend on tokens i-2..i only."""
    cfg = _config(n_layer=1, sliding_window=3)
    model = GPT(cfg)
    assert model.blocks[0].attn.window == 3 and "window=3" in repr(model.blocks[0].attn)
    idx, _ = _batch(cfg)
    changed = idx.clone()
    changed[:, 2] = (changed[:, 2] + 1) % cfg.vocab_size
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :2], after[:, :2], rtol=0, atol=0)
    torch.testing.assert_close(before[:, 5:], after[:, 5:], rtol=0, atol=0)  # beyond the window
    assert not torch.allclose(before[:, 4], after[:, 4])  # the window's far edge
    # a window as long as the sequence is plain causal attention
    wide = GPT(_config(n_layer=1, sliding_window=cfg.block_size))
    wide.load_state_dict(model.state_dict())
    plain = GPT(_config(n_layer=1))
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(wide(idx), plain(idx), rtol=0, atol=0)


def test_flops_per_token_count_the_keys_a_window_lets_through():
    plain, windowed = GPT(_config()), GPT(_config(sliding_window=4))
    assert windowed.flops_per_token(16) == plain.flops_per_token(4) < plain.flops_per_token(16)
    assert windowed.flops_per_token(3) == plain.flops_per_token(3)  # sequences shorter than the window


def test_bad_sliding_windows_are_refused():
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"GPTConfig: sliding_window must be None or at least 1, received {bad}"):
            _config(sliding_window=bad)
    for bad, kind in ((2.5, "float"), (True, "bool"), ("4", "str")):
        with pytest.raises(TypeError, match=f"GPTConfig: sliding_window must be None or an int, received {kind}"):
            _config(sliding_window=bad)
    with pytest.raises(ValueError, match=r"ParallelAttention: window=4 needs causal=True"):
        ParallelAttention(64, 4, causal=False, window=4)


def test_bad_idx_is_refused(seed):
    model = GPT(_config())
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="must be an int64"):
        model(torch.zeros(1, 4))


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_pipeline_stages_compose_to_the_model(seed, num_stages):
    cfg = _config(n_layer=3)
    model = GPT(cfg)
    idx, _ = _batch(cfg)
    x = idx
    for s in range(num_stages):
        x = model.pipeline_stage(s, num_stages)(x)
    torch.testing.assert_close(x, model(idx))
    with pytest.raises(ValueError, match="4 stages for 3 layers"):
        model.pipeline_stage(0, 4)


def test_the_last_stage_gives_its_fused_loss_through_its_forward(seed):
    """``stage(output, targets=t)`` is ``stage.loss(output, t)``: the form a schedule's loss_fn uses through FSDP."""
    cfg = _config(n_layer=2)
    model = GPT(cfg)
    idx, targets = _batch(cfg)
    first, last = model.pipeline_stage(0, 2), model.pipeline_stage(1, 2, fused_loss=True)
    hidden = last(first(idx))
    torch.testing.assert_close(last(hidden, targets=targets), last.loss(hidden, targets))
    torch.testing.assert_close(last(hidden, targets=targets), model(idx, targets=targets))
    with pytest.raises(ValueError, match="only the last stage holds the head"):
        first(idx, targets=targets)


# ---------------------------------------------------------------------------------------------------- tensor parallel


def _self_group(rank, world_size):
    groups = [dist.new_group([r]) for r in range(world_size)]
    return groups[rank]


def _gather_last(x):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def _tp_vs_dense(rank, world_size, cfg_kw, sequence_parallel):
    cfg = _config(**{"n_layer": 1, **cfg_kw})  # one block: the interpreter runs every GEMM
    solo = _self_group(rank, world_size)
    torch.manual_seed(0)
    dense = GPT(cfg, tp_group=solo)
    torch.manual_seed(0)
    par = GPT(cfg, tp_group=None, sequence_parallel=sequence_parallel, overlap=True)
    idx, targets = _batch(cfg)
    dense_logits = dense(idx)
    dense_loss = dense.loss_from_logits(dense_logits, targets)
    dense_loss.backward()
    par_logits = par(idx)
    par_loss = par.loss_from_logits(par_logits, targets)
    par_loss.backward()
    torch.testing.assert_close(_gather_last(par_logits.detach()), dense_logits.detach(), **TOL)
    torch.testing.assert_close(par_loss, dense_loss, **TOL)
    dense_grads = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        want = shard_like(dense_grads[name].grad, p, None)
        torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")
    return par_loss.item()


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_gpt_matches_dense(world_size, sequence_parallel):
    cfg_kw = dict(n_kv_head=4) if world_size == 4 else {}
    env = REFERENCE_KERNELS if world_size == 4 else None
    losses = run_ranks(_tp_vs_dense, world_size, cfg_kw, sequence_parallel, timeout=300, env=env)
    assert len(set(losses)) == 1  # every rank computed the same (replicated) loss


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size, n_kv_head", [(4, 2), (4, 1), (2, 1)])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_kv_heads_fewer_than_the_ranks_are_replicated(world_size, n_kv_head, sequence_parallel):
    """Each rank holds the kv head its query heads read; every copy's gradient is the dense model's whole one
    (``shard_like`` of the dense gradient places each head on every rank holding it)."""
    env = REFERENCE_KERNELS if world_size == 4 else None  # two ranks: the kernels in the interpreter, GQA 2:1
    losses = run_ranks(_tp_vs_dense, world_size, dict(n_kv_head=n_kv_head), sequence_parallel, timeout=300, env=env)
    assert len(set(losses)) == 1


@pytest.mark.multiprocess
def test_recomputed_tensor_parallel_gpt_matches_dense():
    """Recomputation re-runs each block's overlapped all-gather and reduce-scatter rings inside backward,
    on every rank in the same order; the sequence-parallel norm weights still get their TP-summed grads."""
    run_ranks(_tp_vs_dense, 2, dict(n_layer=2, recompute=True), True, timeout=300, env=REFERENCE_KERNELS)


@pytest.mark.multiprocess
def test_tensor_parallel_gpt_with_a_sliding_window_matches_dense():
    run_ranks(_tp_vs_dense, 2, dict(sliding_window=3), True, timeout=300, env=REFERENCE_KERNELS)


@pytest.mark.multiprocess
def test_gelu_layernorm_gpt_with_bias_matches_dense():
    run_ranks(_tp_vs_dense, 2, dict(mlp="gelu", norm="layernorm", bias=True), True, timeout=300,
              env=REFERENCE_KERNELS)  # fmt: skip


def _train_curves(rank, world_size, steps):
    cfg = _config(n_layer=2, vocab_size=64)
    solo = _self_group(rank, world_size)
    curves = []
    for group in (solo, None):
        torch.manual_seed(0)
        model = GPT(cfg, tp_group=group, sequence_parallel=group is None)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        curve = []
        for step in range(steps):
            idx, targets = _batch(cfg, b=4, s=16, seed=step % 5)
            loss = model.loss(idx, targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves.append(curve)
    return curves


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fifty_steps_at_tp2_follow_the_dense_loss_curve():
    # The kernels' own tests cover the Triton paths; here the ranks run the plain-PyTorch references
    # (TRITON_INTERPRET=0) so that 2 × 50 training steps take seconds, not minutes.
    dense, par = run_ranks(_train_curves, 2, 50, timeout=300, env=REFERENCE_KERNELS)[0]
    assert par[-1] < 0.8 * par[0], "the loss must fall"
    # The two runs differ by fp32 summation order only; Adam amplifies that a little over 50 steps.
    torch.testing.assert_close(torch.tensor(par), torch.tensor(dense), rtol=2e-3, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_on_cuda_matches_the_cpu_model(seed, dtype):
    # Every compiled kernel of the model at once (GEMM, flash attention, norms, embedding, cross entropy)
    # against the same model on the CPU. fp32: TF32-free kernels agree to ~1e-5; bf16 rounds every
    # activation to 8 bits: the loss agrees to ~1e-2 and the logits to a few bf16 ulps of their range.
    cfg = _config()
    cpu = GPT(cfg)
    gpu = GPT(cfg, device="cuda", dtype=dtype)
    gpu.load_state_dict({k: v.to(dtype) for k, v in cpu.state_dict().items()})
    idx, targets = _batch(cfg)
    want = cpu.loss(idx, targets)
    got = gpu.loss(idx.cuda(), targets.cuda())
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float().cpu(), want, **tol)
    got.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gpu.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("n_expert", [0, 4], ids=["dense", "experts"])
def test_gpt_forward_and_backward_on_cuda_never_synchronise_the_host(seed, n_expert):
    """Every kernel of a training forward and backward (GEMMs, flash attention, norms, embedding, the fused head
    and loss; the experts' routing and grouped GEMMs) under ``torch.cuda.set_sync_debug_mode("error")``, which
    raises at any call that waits for the device. The first step autotunes the kernels (timing them does
    synchronise) and runs outside the check."""
    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=128, n_expert=n_expert)
    model = GPT(cfg, device="cuda", dtype=torch.bfloat16)
    idx, targets = (t.cuda() for t in _batch(cfg, b=2, s=128))
    model.loss(idx, targets).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.loss(idx, targets).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_recompute_holds_a_fraction_of_the_activation_memory_on_cuda(seed):
    """bf16 on a GPU: the memory a forward leaves allocated for backward, with and without recomputation
    (8 blocks of [4, 1024, 512]: the plain model keeps each block's norm outputs, q/k/v, attention output,
    MLP hidden activations; the recomputed one keeps each block's input), and the gradients agree."""
    results = {}
    for recompute in (False, True):
        cfg = GPTConfig(vocab_size=256, n_layer=8, n_head=8, n_embd=512, block_size=1024, recompute=recompute)
        torch.manual_seed(0)
        model = GPT(cfg, device="cuda", dtype=torch.bfloat16)
        idx, targets = (t.cuda() for t in _batch(cfg, b=4, s=1024))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model.loss(idx, targets)
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        results[recompute] = held, {n: p.grad.float() for n, p in model.named_parameters()}
    assert results[True][0] < 0.3 * results[False][0], (results[True][0], results[False][0])
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, rtol=2e-2, atol=2e-3, msg=name)

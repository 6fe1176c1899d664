"""The mixture-of-experts MLP (layers/moe.py) and tessel's GPT with experts.

One process: the layer against a float64 token-by-token definition (output, aux loss, every gradient), the
routing and the load-balancing loss by hand, bad arguments. On gloo ranks: GPTs with experts under tensor,
expert (over data- and context-parallel ranks) and sequence parallelism against the dense model on every
rank's batch, every gradient compared with the reductions the data-parallel wrapper performs written out.
The layer's tests run the grouped GEMM through Triton's interpreter; the GPT's, which test how the model
composes, run the kernels' plain-PyTorch references (``reference_kernels``, ``REFERENCE_KERNELS``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessel.layers.gpt import GPT, GPTConfig
from tessel.layers.moe import ParallelMoE, load_balancing_loss, route_top_k, router_z_loss
from tessel.parallel.sharding import shard_like
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

TOL = dict(rtol=1e-4, atol=1e-5)
ROUTER_GAIN = 40.0  # routers far from uniform, so that no choice of experts is a near-tie


def _reference(x, router, fc, proj, k, activation, score="softmax", choose=None):
    """float64, one token at a time: ``Σ_k w_k · expert(x)``, Switch's loss and ST-MoE's z-loss over the tokens.
    ``score="sigmoid"``: each expert's score is ``1 / (1 + e^-logit)``; Switch's ``P_x`` averages the scores
    normalised over the experts. ``choose(scores [X]) -> ids [k]``: which experts a token takes (default: the
    ``k`` best)."""
    x, router, fc, proj = (t.double() for t in (x, router, fc, proj))
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ router.T
    scores = torch.softmax(logits, dim=-1) if score == "softmax" else 1 / (1 + torch.exp(-logits))
    probs = scores / scores.sum(-1, keepdim=True)
    out = []
    chosen = torch.zeros(router.shape[0], dtype=torch.float64)
    for n in range(tokens.shape[0]):
        ids = scores[n].topk(k)[1] if choose is None else choose(scores[n].detach())
        top = scores[n][ids]
        row = torch.zeros_like(tokens[n])
        for w, e in zip(top / top.sum(), ids.tolist()):
            h = fc[e] @ tokens[n]
            if activation == "swiglu":
                gate, up = h.chunk(2)
                h = F.silu(gate) * up
            else:
                h = F.gelu(h)
            row = row + w * (proj[e] @ h)
            chosen[e] += 1
        out.append(row)
    n_tok = tokens.shape[0]
    aux = router.shape[0] * ((chosen / (n_tok * k)) * probs.mean(0)).sum()
    z = torch.stack([torch.log(torch.exp(row).sum()) ** 2 for row in logits]).mean()
    return torch.stack(out).view(x.shape), aux, z


def _layer(n_embd=32, hidden=24, n_expert=5, top_k=2, activation="swiglu", seed=0):
    torch.manual_seed(seed)
    moe = ParallelMoE(n_embd, hidden, n_expert, top_k, activation=activation)
    with torch.no_grad():
        moe.router.mul_(ROUTER_GAIN / 4)
        moe.fc.mul_(10)
        moe.proj.mul_(10)
    return moe


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("n_expert, top_k", [(5, 2), (4, 1), (3, 3)])
def test_moe_matches_a_float64_token_by_token_definition(activation, n_expert, top_k):
    moe = _layer(n_expert=n_expert, top_k=top_k, activation=activation)
    x = torch.randn(2, 7, 32, requires_grad=True)
    params = (moe.router, moe.fc, moe.proj)
    leaves = [p.detach().double().requires_grad_() for p in params]
    x64 = x.detach().double().requires_grad_()
    want, want_aux, want_z = _reference(x64, *leaves, top_k, activation)
    got = moe(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(moe.aux_loss.double(), want_aux, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.z_loss.double(), want_z, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(got)
    ((got * dout).sum() + 0.3 * moe.aux_loss + 0.02 * moe.z_loss).backward()
    ((want * dout.double()).sum() + 0.3 * want_aux + 0.02 * want_z).backward()
    for name, g, w in [("x", x.grad, x64.grad)] + [(n, p.grad, q.grad) for n, p, q in
                                                     zip(("router", "fc", "proj"), params, leaves)]:  # fmt: skip
        assert g is not None, name
        err = ((g.double() - w).abs().max() / w.abs().max()).item()
        assert err < 1e-4, f"grad of {name}: relative error {err:.3g}"


@pytest.mark.parametrize("n_expert, top_k", [(5, 2), (4, 1)])
def test_sigmoid_routed_moe_matches_the_float64_definition(n_expert, top_k):
    """DeepSeek-V3's routing: the experts of the k largest sigmoids, weighted by them renormalised."""
    moe = _layer(n_expert=n_expert, top_k=top_k)
    moe.router_score = "sigmoid"
    assert "sigmoid top" in repr(moe)
    check_against_reference(moe, "sigmoid")


def check_against_reference(moe, score, choose=None):
    """The layer's output, losses and gradients (x, router, fc, proj) against :func:`_reference`."""
    x = torch.randn(2, 7, 32, requires_grad=True)
    params = (moe.router, moe.fc, moe.proj)
    leaves = [p.detach().double().requires_grad_() for p in params]
    x64 = x.detach().double().requires_grad_()
    want, want_aux, want_z = _reference(x64, *leaves, moe.top_k, moe.activation, score=score, choose=choose)
    got = moe(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(moe.aux_loss.double(), want_aux, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.z_loss.double(), want_z, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(got)
    ((got * dout).sum() + 0.3 * moe.aux_loss).backward()
    ((want * dout.double()).sum() + 0.3 * want_aux).backward()
    for name, g, w in [("x", x.grad, x64.grad)] + [(n, p.grad, q.grad) for n, p, q in
                                                     zip(("router", "fc", "proj"), params, leaves)]:  # fmt: skip
        err = ((g.double() - w).abs().max() / w.abs().max()).item()
        assert err < 1e-4, f"grad of {name}: relative error {err:.3g}"


def test_sigmoid_routing_by_hand():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    weights, ids, probs = route_top_k(logits, 2, score="sigmoid")
    s = torch.sigmoid(logits)
    assert ids.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(weights[1], s[1, [3, 0]] / s[1, [3, 0]].sum())
    torch.testing.assert_close(probs, s / s.sum(-1, keepdim=True))
    biased = route_top_k(logits, 2, torch.tensor([0.0, 0.0, 0.0, 0.5]), score="sigmoid")
    assert biased[1].tolist()[0] == [1, 3]  # σ(-1) + 0.5 = 0.77 passes σ(1) = 0.73
    torch.testing.assert_close(biased[0][0], s[0, [1, 3]] / s[0, [1, 3]].sum())  # weighed without the bias
    with pytest.raises(
        ValueError, match=r"route_top_k: score must be one of \('softmax', 'sigmoid'\), received 'relu'"
    ):
        route_top_k(logits, 2, score="relu")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_moe_on_cuda_matches_the_float64_definition(activation):
    """The compiled GEMMs of every expert (fp32, TF32-free) and the CUDA routing against float64."""
    moe = _layer(activation=activation).cuda()
    x = torch.randn(3, 37, 32, device="cuda", requires_grad=True)
    leaves = [p.detach().cpu().double().requires_grad_() for p in (moe.router, moe.fc, moe.proj)]
    x64 = x.detach().cpu().double().requires_grad_()
    want, want_aux, want_z = _reference(x64, *leaves, 2, activation)
    got = moe(x)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(moe.aux_loss.cpu().double(), want_aux, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.z_loss.cpu().double(), want_z, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(got)
    (got * dout).sum().backward()
    (want * dout.cpu().double()).sum().backward()
    for g, w in zip((x.grad, moe.router.grad, moe.fc.grad, moe.proj.grad), (x64.grad, *(q.grad for q in leaves))):
        assert ((g.cpu().double() - w).abs().max() / w.abs().max()).item() < 1e-4


@pytest.mark.gpu
def test_moe_forward_on_cuda_never_synchronises_the_host():
    """Routing, the counts per expert (binary search in the sorted ids: torch.bincount reads the ids' extremes on
    the host) and the grouped GEMMs, under ``torch.cuda.set_sync_debug_mode("error")``. The first call autotunes
    the GEMMs (timing them does synchronise) and runs outside the check."""
    moe = _layer().cuda()
    x = torch.randn(3, 37, 32, device="cuda")
    moe(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_counts_per_expert_are_bincounts_of_the_sorted_ids():
    from tessel.layers.routes import sorted_counts

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (50,), generator=gen)
    got = sorted_counts(torch.sort(ids).values, 7)
    assert got.dtype == torch.int64 and torch.equal(got, torch.bincount(ids, minlength=7))
    beyond = torch.sort(torch.cat((ids, torch.tensor([7, 9])))).values  # ids of n and above count for none
    assert torch.equal(sorted_counts(beyond, 7), got)
    assert torch.equal(sorted_counts(torch.tensor([3, 3]), 2), torch.zeros(2, dtype=torch.int64))


def test_routing_weights_sum_to_one_and_choose_the_most_probable():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    weights, ids, probs = route_top_k(logits, 2)
    assert ids.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(weights[0], p[0, [1, 2]] / p[0, [1, 2]].sum())
    torch.testing.assert_close(probs, p)


def test_load_balancing_loss_is_one_when_balanced_and_grows_with_imbalance():
    uniform = torch.full((4,), 8 / 4)  # 8 tokens, probabilities 1/4 each, summed
    assert load_balancing_loss(torch.tensor([4, 4, 4, 4]), uniform, tokens=8, k=2).item() == pytest.approx(1.0)
    # every route to expert 0, which the router also favours: X · f_0 · P_0 = 4 · 1 · 0.7
    skewed = torch.tensor([0.7, 0.1, 0.1, 0.1]) * 8
    assert load_balancing_loss(torch.tensor([8, 0, 0, 0]), skewed, tokens=8, k=1).item() == pytest.approx(2.8)


def test_router_z_loss_is_the_mean_squared_log_sum_exp():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, -1.0, 0.5, 3.0], [-30.0, 40.0, 0.0, 1.0]])
    want = torch.tensor([math.log(4.0), math.log(sum(math.exp(v) for v in (2.0, -1.0, 0.5, 3.0))), 40.0])
    torch.testing.assert_close(router_z_loss(logits), want.square().mean(), rtol=1e-6, atol=1e-5)
    # shifting every logit of a row by c changes the softmax nowhere, the z-loss by (lse + c)²: what it penalises
    assert router_z_loss(logits[:1] + 5) > router_z_loss(logits[:1]) and router_z_loss(logits[:1] - 1.3863) < 1e-8


def test_experts_no_route_reaches_still_get_a_zero_gradient():
    moe = _layer(n_expert=4, top_k=1)
    with torch.no_grad():
        moe.router.zero_()
        moe.router[2].fill_(1.0)  # every token (of positive sum) prefers expert 2
    x = torch.rand(3, 5, 32) + 0.1
    moe(x).sum().backward()
    assert moe.fc.grad[[0, 1, 3]].abs().sum() == 0 and moe.fc.grad[2].abs().sum() > 0
    assert moe.aux_loss.item() == pytest.approx(4 * 1.0 * torch.softmax(moe.router @ x[0, 0], 0)[2].item(), rel=0.2)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(n_expert=0), ValueError, r"n_expert must be a positive int, received 0"),
        (dict(top_k=6), ValueError, r"top_k=6 exceeds n_expert=5"),
        (dict(activation="relu"), ValueError, r"activation must be one of \('swiglu', 'gelu'\), received 'relu'"),
        (dict(hidden=2.5), ValueError, r"hidden must be a positive int, received 2.5"),
        (dict(ep_group=3), TypeError, r"ep_group must be None or a torch.distributed ProcessGroup, received int"),
        (
            dict(router_score="relu"),
            ValueError,
            r"router_score must be one of \('softmax', 'sigmoid'\), received 'relu'",
        ),
    ],
)
def test_bad_arguments_are_refused(kw, error, match):
    args = dict(n_embd=32, hidden=24, n_expert=5, top_k=2) | kw
    with pytest.raises(error, match=match):
        ParallelMoE(args.pop("n_embd"), args.pop("hidden"), args.pop("n_expert"), args.pop("top_k"), **args)


def test_wrong_input_width_is_refused():
    with pytest.raises(ValueError, match=r"last dim must be n_embd=32, received shape \(2, 3, 16\)"):
        _layer()(torch.randn(2, 3, 16))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(n_expert=-1), "n_expert must be a non-negative int"),
        (dict(n_expert=4, top_k=5), r"top_k must be in \[1, n_expert=4\], received 5"),
        (dict(n_expert=4, top_k=0), r"top_k must be in \[1, n_expert=4\], received 0"),
        (dict(n_expert=4, bias=True), "the experts have no biases"),
        (dict(n_expert=4, aux_loss_coef=-0.1), "aux_loss_coef must be a finite non-negative number"),
        (dict(n_expert=4, z_loss_coef=float("nan")), "z_loss_coef must be a finite non-negative number"),
        (dict(n_expert=4, z_loss_coef=True), "z_loss_coef must be a finite non-negative number"),
        (dict(n_expert=4, router_score="tanh"), r"router_score must be one of \('softmax', 'sigmoid'\)"),
    ],
)
def test_gpt_config_refuses_bad_expert_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(n_embd=64, n_head=4, **kw)


def _config(**kw):
    base = dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=16, n_expert=4, top_k=2,
                mlp_hidden=32, aux_loss_coef=0.05, z_loss_coef=0.01)  # fmt: skip
    return GPTConfig(**{**base, **kw})


def _sharpen(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ParallelMoE):
                m.router.mul_(ROUTER_GAIN)


def test_gpt_with_experts_counts_its_active_parameters():
    cfg = _config()
    gpt = GPT(cfg)
    expert = sum(m.fc.numel() + m.proj.numel() for m in gpt.modules() if isinstance(m, ParallelMoE))
    assert expert == cfg.n_layer * cfg.n_expert * 3 * cfg.n_embd * cfg.mlp_hidden
    dense_part = gpt.num_params(include_embedding=False) - expert
    assert gpt.active_params() == dense_part + expert * cfg.top_k // cfg.n_expert
    assert gpt.flops_per_token(8) == 6 * gpt.active_params() + 12 * cfg.n_layer * cfg.n_embd * 8


def test_gpt_loss_adds_the_mean_load_balancing_loss():
    cfg = _config()
    torch.manual_seed(0)
    gpt = GPT(cfg)
    idx = torch.randint(cfg.vocab_size, (2, 8))
    ce = gpt.loss_from_logits(gpt(idx), idx)
    aux = torch.stack([b.mlp.aux_loss for b in gpt.blocks]).mean()
    z = torch.stack([b.mlp.z_loss for b in gpt.blocks]).mean()
    assert z > 0 and torch.equal(gpt.z_loss(), z) and torch.equal(gpt.aux_loss(), aux)
    torch.testing.assert_close(gpt.loss(idx, idx), ce + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z)
    dense = GPT(_config(n_expert=0))
    dense(idx)
    assert dense.aux_loss() is None and dense.z_loss() is None and dense.router_loss() is None


@pytest.mark.usefixtures("reference_kernels")
def test_recomputed_gpt_with_experts_gives_the_same_gradients():
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        gpt = GPT(_config(recompute=recompute))
        _sharpen(gpt)
        idx = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(1))
        gpt.loss(idx, idx).backward()
        grads.append({n: p.grad for n, p in gpt.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=0, msg=name)


@pytest.mark.usefixtures("reference_kernels")
def test_pipeline_stages_train_the_load_balancing_loss_through_aux_grad(num_stages=3):
    """Stages chained by hand, the loss only on the last: with aux_grad = 1 / n_layer every block's router
    gets GPT.loss's gradient (its load-balancing and z-loss terms included); without it, a different one."""
    cfg = _config(n_layer=3)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    _sharpen(gpt)
    idx = torch.randint(cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    gpt.loss(idx, idx).backward()
    want = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    for weight in (1 / cfg.n_layer, None):
        gpt.zero_grad()
        stages = [gpt.pipeline_stage(i, num_stages) for i in range(num_stages)]
        x = idx
        for stage in stages:
            stage.aux_grad = weight
            x = stage(x)
        gpt.loss_from_logits(x, idx).backward()
        close = [torch.allclose(p.grad, want[n], rtol=1e-5, atol=1e-7) for n, p in gpt.named_parameters()]
        if weight is None:
            assert not all(close)  # the routers miss the load-balancing gradient
        else:
            assert all(close), [n for (n, _), ok in zip(gpt.named_parameters(), close) if not ok]


# ---------------------------------------------------------------------------------------------------- parallel


def _solo(rank, world_size):
    return [dist.new_group([r]) for r in range(world_size)][rank]


def _gathered(x, group, dim):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


def _moe_vs_dense(rank, world_size, layout, sequence_parallel, cfg_kw):
    """Each rank's parallel GPT against the dense GPT on that rank's batch (another batch per dp index)."""
    from tessel.layers.parallelize import parallelize
    from tessel.parallel.dims import init_parallel

    tp, ep = layout
    dims = init_parallel(tp=tp, ep=ep)
    solo = _solo(rank, world_size)
    cfg = _config(**cfg_kw)
    torch.manual_seed(0)
    dense = GPT(cfg, tp_group=solo)
    torch.manual_seed(0)
    par = GPT(cfg, tp_group=dims.tp_group, sequence_parallel=sequence_parallel, ep_group=dims.ep_group)
    torch.manual_seed(0)  # the dense model split by parallelize holds the same shards
    via = parallelize(GPT(cfg, tp_group=solo), dims.tp_group, sequence_parallel=sequence_parallel,
                      ep_group=dims.ep_group)  # fmt: skip
    assert via.state_dict().keys() == par.state_dict().keys()
    assert all(torch.equal(v, par.state_dict()[k]) for k, v in via.state_dict().items())
    assert all(getattr(p, "expert_range", None) == getattr(q, "expert_range", None)
               for p, q in zip(via.parameters(), par.parameters()))  # fmt: skip
    _sharpen(dense)
    _sharpen(par)
    gen = torch.Generator().manual_seed(100 + dims.dp_rank)
    idx = torch.randint(cfg.vocab_size, (2, 9), generator=gen)
    idx, targets = idx[:, :-1], idx[:, 1:]
    want = dense.loss(idx, targets)
    want.backward()
    got = par.loss(idx, targets)
    got.backward()
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(_gathered(par(idx).detach(), dims.tp_group, -1), dense(idx).detach(), **TOL)
    dense_grads = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        g = dense_grads[name].grad
        if getattr(p, "expert_parallel", False):  # this rank's experts computed every ep peer's routes
            g = g.clone()
            dist.all_reduce(g, group=dims.ep_group)
        torch.testing.assert_close(p.grad, shard_like(g, p, dims.tp_group), **TOL,
                                   msg=lambda m, name=name: f"rank {rank}, grad of {name}: {m}")  # fmt: skip
    return round(got.item(), 5)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world_size, layout, sequence_parallel",
    [
        (2, (2, 1), False),
        (2, (2, 1), True),
        (2, (1, 2), False),
        (4, (2, 2), False),
        (4, (2, 2), True),
    ],
    ids=["tp2", "tp2-sp", "dp2-ep2", "tp2-dp2-ep2", "tp2-dp2-ep2-sp"],
)
def test_gpt_with_experts_matches_dense(world_size, layout, sequence_parallel):
    losses = run_ranks(_moe_vs_dense, world_size, layout, sequence_parallel, {}, timeout=300, env=REFERENCE_KERNELS)
    if layout[1] > 1:  # the ep peers trained on other batches
        assert len(set(losses)) > 1


@pytest.mark.multiprocess
def test_sigmoid_routed_experts_split_by_features_and_ranks_match_dense():
    """DeepSeek-V3's routing (sigmoid scores, routing biases) under tp=2 with sequence parallelism × ep=2."""
    cfg_kw = {"router_score": "sigmoid", "expert_bias_rate": 0.01}
    run_ranks(_moe_vs_dense, 4, (2, 2), True, cfg_kw, timeout=300, env=REFERENCE_KERNELS)


@pytest.mark.multiprocess
def test_gelu_experts_with_recomputation_over_four_ep_ranks_match_dense():
    run_ranks(_moe_vs_dense, 4, (1, 4), False, dict(mlp="gelu", n_expert=8, top_k=3, recompute=True), timeout=300,
              env=REFERENCE_KERNELS)  # fmt: skip


def _context_vs_dense(rank, world_size, expert_parallel):
    """cp=2 (ep over the cp ranks, or none): gradients averaged over cp are the dense model's on the sequence."""
    from tessel.parallel.context import split_sequence

    cp, solo = dist.new_group([0, 1]), _solo(rank, world_size)
    cfg = _config()
    torch.manual_seed(0)
    dense = GPT(cfg, tp_group=solo)
    torch.manual_seed(0)
    par = GPT(cfg, tp_group=solo, cp_group=cp, ep_group=cp if expert_parallel else None)
    _sharpen(dense)
    _sharpen(par)
    idx = torch.randint(cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    idx, targets = idx[:, :-1], idx[:, 1:]
    want = dense.loss(idx, targets)
    want.backward()
    got = par.loss(split_sequence(idx, cp), split_sequence(targets, cp))
    got.backward()
    torch.testing.assert_close(par.aux_loss(), dense.aux_loss(), **TOL)  # the whole sequence's
    torch.testing.assert_close(par.z_loss(), dense.z_loss(), **TOL)
    dist.all_reduce(got.detach(), group=cp)
    dense_grads = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        g = p.grad.clone()
        if not getattr(p, "expert_parallel", False):  # averaged over cp as the data-parallel wrapper does
            dist.all_reduce(g, group=cp)
        want_g = shard_like(dense_grads[name].grad, p, solo)
        torch.testing.assert_close(g / 2, want_g, **TOL, msg=lambda m, name=name: f"rank {rank}, grad of {name}: {m}")
    return "ok"


@pytest.mark.multiprocess
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["cp2", "cp2-ep2"])
def test_gpt_with_experts_under_context_parallelism_matches_dense(expert_parallel):
    assert run_ranks(_context_vs_dense, 2, expert_parallel, timeout=300, env=REFERENCE_KERNELS) == ["ok"] * 2


def _refusals(rank, world_size):
    with pytest.raises(ValueError, match=r"tp_group and ep_group share the ranks \[0, 1\]"):
        ParallelMoE(32, 24, 4, 2, tp_group=None, ep_group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"n_expert=3 does not split over the 2 ranks of ep_group"):
        ParallelMoE(32, 24, 3, 2, tp_group=_solo(rank, world_size), ep_group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"hidden=25 does not split over the 2 tensor-parallel ranks"):
        ParallelMoE(32, 25, 4, 2, tp_group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"ep_group splits the experts over ranks, but the config has none"):
        GPT(_config(n_expert=0), tp_group=_solo(rank, world_size), ep_group=dist.group.WORLD)
    return "ok"


@pytest.mark.multiprocess
def test_expert_groups_that_cannot_work_are_refused():
    assert run_ranks(_refusals, 2, env=REFERENCE_KERNELS) == ["ok"] * 2

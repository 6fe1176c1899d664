"""Expert parallelism over data-parallel ranks: ``parallelize(ep_group=)`` on Hugging Face mixtures of experts.

Each data-parallel rank trains on its own batch; the ranks of an expert-parallel group hold different experts
and send every (token, choice) route to its expert's rank by all-to-all. The reference is the dense model on
every rank's batch: the mean of the ranks' losses. What each parallel rank's gradients must sum to (the
reductions a data-parallel wrapper performs, written out here so that the layers are tested on their own):

- a dense parameter: the sum over the data-parallel group of the ranks' gradients is the dense gradient;
- an expert parameter (``expert_parallel``): the all-to-all's backward already summed the expert-parallel
  group's contributions; the sum over the expert-data-parallel group (the ranks holding the same experts) is
  the dense gradient of this rank's experts.

Layouts (``d`` the data-parallel index, tensor-parallel ranks innermost): 2 ranks dp=2 ep=2; 4 ranks dp=4 ep=2
(two replicas of each expert); tp=2 × dp=2 ep=2 with and without sequence parallelism. fp32, the tolerance of
tests/layers/test_hf.py. The routers' weights are scaled up so that fp32 reordering cannot flip a route.
"""

import copy

import pytest
import torch

from tests.layers.test_hf import REFERENCE_KERNELS, VOCAB, B, S, _assert_unchanged, _close, _state, needs_hf
from tests.layers.test_hf_experts import _moe
from tests.multiprocess import run_ranks
from tests.parallel.test_zero import _equal_state


def _groups(rank, world_size, tp, ep):
    """(tp, dp, ep and expert-dp groups, dp rank, dp size) of this rank; global rank = d·tp + t."""
    import torch.distributed as dist

    dp = world_size // tp
    d = rank // tp

    def mine(groups):
        return dist.new_subgroups_by_enumeration(groups)[0]

    tp_group = mine([[d_ * tp + t for t in range(tp)] for d_ in range(dp)])
    dp_group = mine([[d_ * tp + t for d_ in range(dp)] for t in range(tp)])
    ep_group = mine([[(g * ep + e) * tp + t for e in range(ep)] for g in range(dp // ep) for t in range(tp)])
    edp_group = mine([[(g * ep + e) * tp + t for g in range(dp // ep)] for e in range(ep) for t in range(tp)])
    return tp_group, dp_group, ep_group, edp_group, d, dp


def _batch(d):
    gen = torch.Generator().manual_seed(10 + d)
    return torch.randint(VOCAB, (B, S), generator=gen), torch.randn(B, S, VOCAB, generator=gen)


def _loss(model, ids, weights, dp):
    logits = model(ids).logits
    return logits, (logits * weights).sum() / dp


def _check(dense, par, groups, tag):
    """par on batch d against dense on every batch; gradients reduced as DDP(expert_group=) would."""
    import torch.distributed as dist

    from tessel.parallel.comm import group_rank
    from tessel.parallel.sharding import shard_like

    tp_group, dp_group, ep_group, edp_group, d, dp = groups
    for i in range(dp):
        logits, loss = _loss(dense, *_batch(i), dp)
        loss.backward()
        if i == d:
            want_logits = logits.detach()
    got_logits, loss = _loss(par, *_batch(d), dp)
    loss.backward()
    _close(got_logits, want_logits, msg=lambda m: f"{tag} logits: {m}")
    dense_params = dict(dense.named_parameters())
    ep_rank = group_rank(ep_group)
    for name, p in par.named_parameters():
        grad = p.grad.clone()
        want = dense_params[name].grad
        if getattr(p, "expert_parallel", False):
            dist.all_reduce(grad, group=edp_group)
            n = p.shape[0]
            want = want[ep_rank * n : (ep_rank + 1) * n]
            assert torch.equal(p.detach(), dense_params[name].detach()[ep_rank * n : (ep_rank + 1) * n]), name
        else:
            dist.all_reduce(grad, group=dp_group)
            want = shard_like(want, p, tp_group)
        _close(grad, want, msg=lambda m, name=name: f"{tag} grad of {name}: {m}")


def _layout(rank, world_size, tp, ep, cases):
    from tessel.layers.parallelize import parallelize

    groups = _groups(rank, world_size, tp, ep)
    tp_group, ep_group = groups[0], groups[2]
    for family, impl, sp in cases:
        dense = _moe(family)
        dense.set_experts_implementation(impl)
        par = parallelize(copy.deepcopy(dense), tp_group, sequence_parallel=sp, ep_group=ep_group)
        experts = next(m for n, m in par.named_modules() if n.endswith("mlp.experts"))
        assert experts.num_experts == 4 // ep
        assert all(getattr(p, "expert_parallel", False) and not getattr(p, "tensor_parallel", False)
                   for p in experts.parameters())  # fmt: skip
        _check(dense, par, groups, f"{family} {impl} tp={tp} ep={ep} sp={sp}")
    return tp_group, ep_group


def _two_ranks(rank, world_size):
    tp_group, ep_group = _layout(rank, world_size, 1, 2, [
        ("mixtral", "eager", False),
        ("qwen2_moe", "grouped_mm", False),  # a shared expert and its gate beside the experts
        ("qwen3_moe", "batched_mm", False),  # a dense MLP layer among the expert layers
        ("glm4_moe", "eager", False),  # a shared expert split by the model's own plan
    ])  # fmt: skip
    from tessel.layers.parallelize import parallelize

    # greedy generation with a cache, each rank its own prompt and its own number of new tokens: every forward
    # joins the all-to-alls, so the ranks step together (Hugging Face's synced_gpus keeps a rank that has
    # finished running forwards until every rank has) and each gets the dense model's tokens
    dense = _moe("mixtral").eval()
    prompt, new = _batch(rank)[0][:, :5], 3 + 2 * rank
    with torch.inference_mode():
        want = dense.generate(prompt, max_new_tokens=new, do_sample=False)
        par = parallelize(copy.deepcopy(dense), tp_group, ep_group=ep_group)
        got = par.generate(prompt, max_new_tokens=new, do_sample=False, synced_gpus=True)
    assert torch.equal(got, want), (got, want)
    # the refusals leave the model as it was
    model = _moe("mixtral")
    before, types = _state(model), [type(m) for m in model.modules()]
    with pytest.raises(TypeError, match=r"ep_group must be None or a torch.distributed ProcessGroup, received int"):
        parallelize(model, tp_group, ep_group=2)
    with pytest.raises(ValueError, match=r"tp_group and ep_group share the ranks \[0, 1\]"):
        parallelize(model, ep_group, ep_group=ep_group)
    with pytest.raises(ValueError, match=r"experts fed every token once per expert are split by 'features' only"):
        parallelize(_moe("llama4"), tp_group, ep_group=ep_group)
    with pytest.raises(ValueError, match=r"the 3 experts do not split over the 2 ranks of the group"):
        parallelize(_moe("mixtral", num_local_experts=3), tp_group, ep_group=ep_group)
    from tests.layers.test_hf import _model

    with pytest.raises(ValueError, match=r"ep_group was given, but the plan splits no experts module of LlamaFor"):
        parallelize(_model("llama"), tp_group, ep_group=ep_group)
    _assert_unchanged(model, before, types)
    return "ok"


def _four_ranks(rank, world_size):
    _layout(rank, world_size, 1, 2, [("mixtral", "eager", False), ("qwen2_moe", "grouped_mm", False)])
    _layout(rank, world_size, 2, 2, [("mixtral", "eager", False), ("mixtral", "grouped_mm", True),
                                     ("qwen2_moe", "eager", True), ("glm4_moe", "grouped_mm", True)])  # fmt: skip
    _shared_between_tensor_parallel_ranks(rank, world_size)
    _over_context_ranks(rank, world_size)
    return "ok"


def _shared_between_tensor_parallel_ranks(rank, world_size):
    """tp=2 × dp=2 without sequence parallelism: the tensor-parallel ranks hold the same tokens and each
    dispatches half of them; an odd token count (one-token decoding steps of one row) is padded."""
    import tessel.layers.hf_experts as hf_experts
    from tessel.layers.parallelize import parallelize

    groups = _groups(rank, world_size, 2, 2)
    tp_group, ep_group, d = groups[0], groups[2], groups[4]
    sent, exchange = [], hf_experts.exchange_rows

    def spy(x, group, send, recv, rows=None):  # records the dispatches of hidden rows (their size unknown)
        if rows is None:
            sent.append([int(c) for c in send])
        return exchange(x, group, send, recv, rows=rows)

    hf_experts.exchange_rows = spy
    try:
        dense = _moe("mixtral")
        par = parallelize(copy.deepcopy(dense), tp_group, ep_group=ep_group)
        _check(dense, par, groups, "tp=2 ep=2 tokens shared between tp ranks")
        # each tp rank sends half of its B·S tokens' routes (two choices each), in each of the two expert layers
        assert [sum(c) for c in sent] == [B * S // 2 * 2] * 2, sent
        dense = _moe("mixtral").eval()
        prompt = _batch(d)[0][:1, :5]  # one row: every decoding step holds one token for two tp ranks
        with torch.inference_mode():
            want = dense.generate(prompt, max_new_tokens=3, do_sample=False)
            par = parallelize(copy.deepcopy(dense), tp_group, ep_group=ep_group)
            assert torch.equal(par.generate(prompt, max_new_tokens=3, do_sample=False, synced_gpus=True), want)
    finally:
        hf_experts.exchange_rows = exchange


def _over_context_ranks(rank, world_size):
    """tp=2 × cp=2, the experts split over the cp ranks (which hold one sequence's shards: different tokens).
    The all-to-all's backward sums the cp ranks' contributions: an expert's gradient is complete as it is."""
    import torch.distributed as dist

    from tessel.layers.parallelize import parallelize
    from tessel.parallel.comm import group_rank
    from tessel.parallel.context import gather_sequence, split_sequence
    from tessel.parallel.sharding import shard_like
    from tests.layers.test_context_parallel import _grid
    from tests.layers.test_hf import _batch as _one_batch
    from tests.layers.test_hf import _forward_backward

    _, tp_group, cp_group = _grid(rank, world_size, 2)
    for sp in (False, True):
        dense = _moe("mixtral")
        par = parallelize(copy.deepcopy(dense), tp_group, cp_group=cp_group, sequence_parallel=sp, ep_group=cp_group)
        ids, weights = _one_batch()
        want = _forward_backward(dense, ids, weights)
        got = _forward_backward(par, split_sequence(ids, cp_group), split_sequence(weights, cp_group))
        _close(gather_sequence(got, cp_group), want, msg=lambda m, sp=sp: f"ep over cp, sp={sp}, logits: {m}")
        dense_params = dict(dense.named_parameters())
        for name, p in par.named_parameters():
            grad, want = p.grad.clone(), dense_params[name].grad
            if getattr(p, "expert_parallel", False):
                n, e = p.shape[0], group_rank(cp_group)
                want = want[e * n : (e + 1) * n]
            else:
                dist.all_reduce(grad, group=cp_group)
                want = shard_like(want, p, tp_group)
            _close(grad, want, msg=lambda m, name=name, sp=sp: f"ep over cp, sp={sp}, grad of {name}: {m}")


@pytest.mark.multiprocess
@needs_hf
def test_experts_split_over_data_parallel_ranks_match_dense_on_two_ranks():
    assert run_ranks(_two_ranks, 2, timeout=300, env=REFERENCE_KERNELS) == ["ok"] * 2


@pytest.mark.multiprocess
@needs_hf
def test_experts_split_over_data_parallel_ranks_match_dense_on_four_ranks():
    assert run_ranks(_four_ranks, 4, timeout=400, env=REFERENCE_KERNELS) == ["ok"] * 4


# ---------------------------------------------------------------------------------------------------- training

# Adam moves each weight by about LR per step whatever the gradient's size, so an element whose gradient
# nearly cancels would turn fp32 reordering (~1e-9 absolute there) into a difference of up to a whole step;
# an eps of 1e-4 (the gradients are ~1e-3 to 1e-1) damps such elements, leaving the others' updates alone
STEPS, LR, CLIP, EPS = 3, 1e-2, 0.5, 1e-4
WEIGHTS = dict(rtol=1e-4, atol=1e-5)


def _lm_loss(model, d, aux):
    """The language-model loss of batch d, plus (``aux``) the load-balancing loss of its routing."""
    ids = _batch(d)[0]
    return model(ids, labels=ids, output_router_logits=aux).loss


def _dense_training(dp, clip, aux):
    """One process, the dense model, the mean of the dp ranks' losses (clipped as ZeroAdam clips)."""
    dense = _moe("mixtral", router_aux_loss_coef=0.5)
    opt = torch.optim.AdamW(dense.parameters(), lr=LR, eps=EPS, weight_decay=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        (sum(_lm_loss(dense, d, aux) for d in range(dp)) / dp).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(dense.parameters(), CLIP)
        opt.step()
    return dense


def _training(rank, world_size, tp, ep, sp, zero, aux):
    """init_parallel(ep=) → parallelize(ep_group=) → DDP(expert_group=) with torch's AdamW (``zero=0``) or
    ZeroAdam, clipped (``zero=2``), or FSDP(expert_group=) with ZeroAdam, clipped (``zero=3``: each decoder layer
    a unit, its experts sharded over the expert-data-parallel group, the rest over dp); every weight after STEPS
    steps against the dense run's. Each rank's load-balancing loss (``aux``) is its own batch's, as the dense
    reference's (under sequence parallelism the router logits are gathered over tp)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    from tessel.layers.parallelize import parallelize
    from tessel.parallel import DDP, FSDP, ZeroAdam, init_parallel
    from tessel.parallel.sharding import shard_like

    dims = init_parallel(tp=tp, ep=ep)
    model = _moe("mixtral", router_aux_loss_coef=0.5)
    model = parallelize(model, dims.tp_group, sequence_parallel=sp, ep_group=dims.ep_group)
    if zero == 3:
        wrapper = FSDP(model, dims.dp_group, wrap={MixtralDecoderLayer}, expert_group=dims.expert_dp_group)
        assert {u.bucket.expert for u in wrapper.units} == {False, True}
    else:
        wrapper = DDP(model, dims.dp_group, expert_group=dims.expert_dp_group)
    if zero:
        opt = ZeroAdam(wrapper.parameters(), lr=LR, eps=EPS, weight_decay=0.1, max_grad_norm=CLIP,
                       tp_group=dims.tp_group)  # fmt: skip
    else:
        opt = torch.optim.AdamW(wrapper.parameters(), lr=LR, eps=EPS, weight_decay=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        _lm_loss(wrapper, dims.dp_rank, aux).backward()
        opt.step()
    if zero and tp == 1:
        _check_expert_state(opt, dims)
    dense_params = dict(_dense_training(dims.dp, zero, aux).named_parameters())
    trained = wrapper.full_state_dict() if zero == 3 else dict(model.named_parameters())
    for name, param in model.named_parameters():
        p = trained[name]
        want = dense_params[name].detach()
        if getattr(param, "expert_parallel", False):
            n = p.shape[0]
            want = want[dims.ep_rank * n : (dims.ep_rank + 1) * n]
        else:
            want = shard_like(want, param, dims.tp_group)
        torch.testing.assert_close(p.detach(), want, **WEIGHTS, msg=lambda m, name=name: f"{name}: {m}")
    return "ok"


def _check_expert_state(opt, dims):
    """Each rank's ZeroAdam state names its experts; it loads back on its own rank, and a state saved by a rank
    of the other ep index (every rank swaps with its neighbour, so every rank refuses) is refused unchanged."""
    import torch.distributed as dist

    saved = opt.state_dict()
    experts = [entry["experts"] for entry in saved["state"].values() if "experts" in entry]
    n = 4 // dims.ep
    assert experts and set(experts) == {(dims.ep_rank * n, (dims.ep_rank + 1) * n)}, experts
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, saved)
    with pytest.raises(ValueError, match=r"holds experts \[\d, \d\) on this rank, the state dict was saved for"):
        opt.load_state_dict(everyone[dist.get_rank() ^ 1])
    assert _equal_state(opt.state_dict(), saved)
    opt.load_state_dict(saved)
    assert _equal_state(opt.state_dict(), saved)


@pytest.mark.multiprocess
@needs_hf
@pytest.mark.parametrize("world_size, tp, ep, sp, zero, aux", [(2, 1, 2, False, 0, False),
                                                               (4, 1, 2, False, 2, True),
                                                               (4, 2, 2, True, 2, True),
                                                               (4, 1, 2, False, 3, True)])  # fmt: skip
def test_training_with_experts_over_data_parallel_ranks_matches_dense_training(world_size, tp, ep, sp, zero, aux):
    result = run_ranks(_training, world_size, tp, ep, sp, zero, aux, timeout=400, env=REFERENCE_KERNELS)
    assert result == ["ok"] * world_size

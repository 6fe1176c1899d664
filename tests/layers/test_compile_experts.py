"""``torch.compile`` over expert parallelism: a mixture of experts whose experts live on several ranks compiles whole.

The dispatch sends each (token, choice) route to the rank of its expert; how many rows a rank receives depends
on every rank's routing. Eagerly the counts are read on the host; under compile the exchange is the custom
operator ``tessel::exchange_rows`` (``parallel/exchange_op.py``), whose output has a data-dependent length in
the graph and whose node reads the counts when it runs. These tests compile the GPT's training step with
``fullgraph=True`` (it broke the graph at the dispatch before) and check its loss and every gradient against
the eager step's, including a step in which a rank's experts receive no route at all.

Hugging Face mixtures of experts ``parallelize``d compile whole too (with Hugging Face's ``grouped_mm`` or
``batched_mm`` experts; its ``eager`` loop over the experts hit does not compile whole even unsplit): the hooks
around their experts take their arguments by position or keyword (``inspect.Signature.bind`` does not trace)
and dispatch over ``ep_group`` through the same operator.
"""

import importlib.util

import pytest
import torch
import torch.distributed as dist

import tessel.layers.moe as moe
from tessel.layers.gpt import GPT, GPTConfig
from tessel.parallel.collectives import exchange_rows
from tessel.parallel.comm import count_bytes
from tessel.parallel.exchange_op import exchange_rows_op, traced_exchange_rows
from tests.layers.test_compile import _batch, _step_compiles_whole
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

pytestmark = pytest.mark.multiprocess

_EXPERTS = dict(n_expert=4, top_k=2, mlp_hidden=32, aux_loss_coef=0.05, z_loss_coef=0.01)


def _config():
    return GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=16, **_EXPERTS)


def _expert_parallel_step(rank, world_size, tp, sequence_parallel, backend, starve):
    from tessel.parallel.dims import init_parallel

    ep = world_size // tp
    dims = init_parallel(tp=tp, ep=ep)
    cfg = _config()
    if starve:  # every route to the first ep rank's experts: the others receive no row
        route = moe.route_top_k

        def to_first_rank(*args, **kw):
            weights, ids, probs = route(*args, **kw)
            return weights, ids % (cfg.n_expert // ep), probs

        moe.route_top_k = to_first_rank
    torch.manual_seed(0)
    model = GPT(cfg, tp_group=dims.tp_group, sequence_parallel=sequence_parallel, ep_group=dims.ep_group)
    idx, targets = _batch(cfg, s=8, seed=10 + dims.dp_rank)  # another batch per ep peer
    loss = _step_compiles_whole(model, idx, targets, backend=backend)
    dist.barrier()
    return loss.item()


@pytest.mark.parametrize(
    "world_size, tp, sequence_parallel, backend, starve",
    [
        (2, 1, False, "aot_eager", False),
        (2, 1, False, "aot_eager", True),
        (2, 1, False, "inductor", False),
        (4, 2, True, "aot_eager", False),
    ],
    ids=["ep2", "ep2-one-rank-idle", "ep2-inductor", "tp2-ep2-sp"],
)
def test_expert_parallel_training_step_compiles_whole(world_size, tp, sequence_parallel, backend, starve):
    """The training step in one graph on every rank, equal to the eager step: the dispatch and combine exchanges,
    their backwards, the grouped GEMMs over a data-dependent number of rows."""
    losses = run_ranks(
        _expert_parallel_step, world_size, tp, sequence_parallel, backend, starve, timeout=600, env=REFERENCE_KERNELS
    )
    assert len(set(losses)) > 1  # the ep peers trained on other batches


def _exchange_checks(rank, world_size):
    group = dist.group.WORLD
    # rank 0 sends 1 row to itself and 3 to rank 1; rank 1 sends 2 rows to rank 0 and none to itself
    send = torch.tensor([[1, 3], [2, 0]][rank])
    recv = torch.tensor([[1, 2], [3, 0]][rank])
    x = (torch.arange(4 if rank == 0 else 2, dtype=torch.float64)[:, None] + 10 * rank).expand(-1, 3).contiguous()
    x.requires_grad_(True)
    want = torch.tensor([[0.0, 10.0, 11.0], [1.0, 2.0, 3.0]][rank], dtype=torch.float64)

    compiled = torch.compile(traced_exchange_rows, backend="aot_eager", fullgraph=True)
    with count_bytes() as moved:
        got = compiled(x, group, send, recv)
    torch.testing.assert_close(got[:, 0], want)
    # the rows for the other rank, 3 float64 each (a rank's own rows are no traffic)
    assert (moved.sent, moved.received) == ([3, 2][rank] * 24, [2, 3][rank] * 24)
    upstream = torch.arange(got.numel(), dtype=torch.float64).view_as(got)
    got.backward(upstream)  # each row's gradient back to its rank
    x_eager = x.detach().requires_grad_(True)
    eager = exchange_rows(x_eager, group, send.tolist(), recv.tolist())
    eager.backward(upstream)
    assert torch.equal(got, eager) and torch.equal(x.grad, x_eager.grad)
    for rows in (want.shape[0], None):  # known, or decided by the data
        torch.library.opcheck(exchange_rows_op, (x.detach().requires_grad_(True), send, recv, group.group_name, rows))
    assert torch.Tag.cudagraph_unsafe in exchange_rows_op._opoverload.tags  # it reads the counts on the host
    dist.barrier()
    return x.grad.tolist()


def test_exchange_operator_moves_rows_and_gradients_like_the_eager_exchange():
    """``tessel::exchange_rows`` compiled: the rows each rank receives (one rank keeps none of its own) and the
    gradients sent back equal the eager ``exchange_rows``'s; ``torch.library.opcheck`` passes."""
    grads = run_ranks(_exchange_checks, 2, timeout=300, env=REFERENCE_KERNELS)
    # rank 0's rows went to rank 0 (row 0 of its output) and rank 1 (rows 0-2 of its output); rank 1's to rank 0
    assert grads[0] == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]
    assert grads[1] == [[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]


# ------------------------------------------------------------------------------------ Hugging Face mixtures of experts


def _hf_step(rank, world_size, family, sequence_parallel, split, impl):
    import copy

    from tessel.layers.hf_balance import expert_loads
    from tessel.layers.parallelize import parallelize
    from tests.layers.test_hf import _close
    from tests.layers.test_hf_expert_parallel import _batch
    from tests.layers.test_hf_experts import _moe

    dense = _moe(family).train()
    if impl == "tessel":  # tessel's experts implementation (tessel.layers.hf_grouped_experts)
        from tessel.layers import register_hf_experts

        register_hf_experts()
    if impl is not None:  # Hugging Face's "eager" loop over the experts hit does not compile whole
        dense.set_experts_implementation(impl)
    batch = 0
    if split == "ep":  # each rank its own batch and half the experts, every route dispatched by all-to-all
        solo = [dist.new_group([r]) for r in range(world_size)][rank]
        model, batch = parallelize(copy.deepcopy(dense), solo, ep_group=dist.group.WORLD), rank
    elif split == "tp-ep":  # tp 2 x ep 2 over data-parallel ranks: each tp rank dispatches half of its pair's routes
        from tests.layers.test_hf_expert_parallel import _groups

        tp_group, _, ep_group, _, batch, _ = _groups(rank, world_size, 2, 2)
        model = parallelize(copy.deepcopy(dense), tp_group, sequence_parallel=sequence_parallel, ep_group=ep_group)
    else:  # by features, or by experts (under sequence parallelism each route goes to its expert's rank)
        model = parallelize(copy.deepcopy(dense), dist.group.WORLD, sequence_parallel=sequence_parallel,
                            expert_split=split)  # fmt: skip
    ids, weights = _batch(batch)

    def step(run):
        model.zero_grad(set_to_none=True)
        for load in expert_loads(model):
            load.counts.zero_()
        logits = run(ids)
        (logits * weights).sum().backward()
        counts = [load.counts.clone() for load in expert_loads(model)]
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, counts

    eager = step(lambda ids: model(ids).logits)
    torch._dynamo.reset()
    compiled = step(torch.compile(lambda ids: model(ids).logits, backend="aot_eager", fullgraph=True))
    _close(compiled[0], eager[0])  # the tolerance of tests/layers/test_hf.py (fp32 summed in another order)
    for name, want in eager[1].items():
        _close(compiled[1][name], want, msg=lambda m, n=name: f"{n}: {m}")
    assert [c.tolist() for c in compiled[2]] == [c.tolist() for c in eager[2]]  # the routing biases' load counts
    dist.barrier()
    return sum(int(c.sum()) for c in eager[2])


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
@pytest.mark.parametrize(
    "family, sequence_parallel, split, impl",
    [
        ("mixtral", False, "tp-ep", "grouped_mm"),
        ("mixtral", False, "features", "grouped_mm"),
        ("mixtral", True, "features", "grouped_mm"),
        ("deepseek_v3", False, "features", "grouped_mm"),
        ("mixtral", False, "experts", "grouped_mm"),
        ("mixtral", True, "experts", "batched_mm"),
        ("mixtral", False, "ep", "grouped_mm"),
        ("qwen2_moe", True, "features", "batched_mm"),
        ("llama4", True, "features", None),  # its experts take every token once per expert, in batched GEMMs
        ("mixtral", True, "features", "tessel"),
        ("deepseek_v3", False, "experts", "tessel"),  # the other rank's routes as sentinels; load counts on device
    ],
    ids=[
        "mixtral-tp2-ep2",
        "mixtral-tp2",
        "mixtral-tp2-sp",
        "deepseek_v3-tp2",
        "mixtral-experts",
        "mixtral-experts-sp",
        "mixtral-ep2",
        "qwen2_moe-tp2-sp",
        "llama4-tp2-sp",
        "mixtral-tp2-sp-tessel",
        "deepseek_v3-experts-tessel",
    ],
)
def test_parallelized_hugging_face_experts_compile_whole(family, sequence_parallel, split, impl):
    """A Hugging Face mixture of experts ``parallelize``d over two ranks (its experts split by features or by
    experts, or dispatched to the rank of their expert over ``ep_group``), or over tp 2 x ep 2 on four ranks, runs
    forward and backward in one graph,
    equal to the eager run: Mixtral, Qwen2-MoE (a shared expert beside the experts), Llama 4 (experts taking
    every token), DeepSeek-V3, whose routing biases' load counts are the eager ones; Hugging Face's grouped_mm
    and batched_mm experts, and tessel's."""
    world_size = 4 if split == "tp-ep" else 2
    counted = run_ranks(_hf_step, world_size, family, sequence_parallel, split, impl, timeout=600,
                        env=REFERENCE_KERNELS)  # fmt: skip
    assert all(counted) == (family == "deepseek_v3")

"""``torch.compile`` over tessel: kernels, the reference GPT, and the tensor-parallel GPT on gloo ranks.

Flash attention, the norms and matmul (``out=`` without gradients too) are custom operators under compile
(``kernels/library.py``), the collectives of a world of one return before any transport, and those of several
ranks are traced as torch's functional collectives; each overlapped op is, with overlap, its custom operator
(``parallel/overlap_ops.py``), whose nodes run the eager rings, and otherwise its plain composition
(``parallel/overlap.py``). So a model made of them and of torch operations compiles whole (``fullgraph=True``):
the GPT's training step on one rank, on two tensor-parallel ranks (with sequence parallelism or without) and
on two context-parallel ranks, and a Hugging Face Llama with tessel's attention, parallelized over two ranks.

What remains opaque (``kernels._dispatch.opaque_to_compile``): the in-place launchers (``matmul(out=...)`` where
a gradient is needed, the eager rings' steps) and the eager transports, which the layers call under compile only
from inside the overlapped ops' nodes. A mixture of experts compiles whole, over expert-parallel ranks too
(``tests/layers/test_compile_experts.py``). Packed documents compile whole (their segment tables are computed
in the graph), and so does context parallelism, whose ring attention takes its all-gather form there.

Each test runs a model or an op eagerly and compiled from the same weights and inputs and checks that outputs
and every gradient agree.
``aot_eager`` traces forward and backward through AOTAutograd, as inductor does, without generating code, so
the CPU runs stay short; two tests use inductor itself (one on the CPU, one on a GPU).

Without the opaque launchers Dynamo traces into Triton's host code: on a CPU it walks the interpreter's
NumPy emulation of each program and fails.
"""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

import tessel.kernels
from tessel.kernels import flash_attention, grouped_matmul, layer_norm, matmul, rms_norm
from tessel.kernels.attention_inputs import _self_segment_bounds
from tessel.kernels.library import flash_attention_op, grouped_matmul_op, matmul_into_op, matmul_op, norm_op
from tessel.layers.gpt import GPT, GPTConfig
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

TOL = dict(rtol=1e-5, atol=1e-6)


def _config(**kw):
    return GPTConfig(**{**dict(vocab_size=64, n_layer=1, n_head=4, n_kv_head=2, n_embd=64, block_size=16), **kw})


def _batch(cfg, b=2, s=11, seed=3):
    idx = torch.randint(cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return idx[:, :-1], idx[:, 1:]


def _loss_and_grads(model, run, idx, targets):
    model.zero_grad(set_to_none=True)
    logits = run(idx)
    loss = model.loss_from_logits(logits, targets)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compare(eager, compiled):
    for want, got in zip(eager[:2], compiled[:2]):
        torch.testing.assert_close(got, want, **TOL)
    assert eager[2].keys() == compiled[2].keys()
    for name, want in eager[2].items():
        torch.testing.assert_close(compiled[2][name], want, **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")


def _reset():
    torch._dynamo.reset()


def _step_compiles_whole(model, idx, targets, backend="aot_eager", **kw):
    """The training step (forward, loss, backward; ``kw`` to the model) compiled by ``backend`` with fullgraph=True:
    its loss and every gradient equal the eager step's. Returns the loss."""
    eager = _loss_and_grads(model, lambda idx: model(idx, **kw), idx, targets)
    _reset()
    step = torch.compile(lambda idx, targets: model.loss_from_logits(model(idx, **kw), targets), backend=backend,
                         fullgraph=True)  # fmt: skip
    model.zero_grad(set_to_none=True)
    loss = step(idx, targets)
    loss.backward()
    torch.testing.assert_close(loss.detach(), eager[1], **TOL)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, eager[2][name], **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")
    return loss.detach()


def test_compiled_gpt_matches_eager(seed):
    cfg = _config()
    model = GPT(cfg)
    idx, targets = _batch(cfg)
    counter = CompileCounterWithBackend("aot_eager")
    _reset()
    compiled = torch.compile(model, backend=counter)
    eager = _loss_and_grads(model, model, idx, targets)
    _compare(eager, _loss_and_grads(model, compiled, idx, targets))
    assert counter.frame_count >= 1  # something around tessel's kernels was compiled
    _compare(eager, _loss_and_grads(model, compiled, idx, targets))  # the cached graphs run again alike


@pytest.mark.parametrize("op", ["matmul", "flash_attention", "rms_norm", "layer_norm", "grouped_matmul"])
def test_compiled_kernel_ops_match_eager(seed, op):
    """Each differentiable kernel between compiled torch operations, forward and backward."""
    gen = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    if op == "matmul":
        inputs = (rand(13, 24), rand(24, 10), rand(10))
        fn = lambda a, b, bias: matmul(a * 2, b.t().contiguous().t(), bias, "gelu").tanh()
    elif op == "flash_attention":
        inputs = (rand(2, 4, 19, 16), rand(2, 2, 19, 16), rand(2, 2, 19, 16))
        fn = lambda q, k, v: flash_attention(q.sin(), k, v * 0.5, causal=True).square()
    elif op == "rms_norm":
        inputs = (rand(3, 7, 40), rand(40))
        fn = lambda x, w: rms_norm(x + 1, w).exp()
    elif op == "layer_norm":
        inputs = (rand(3, 7, 40), rand(40), rand(40))
        fn = lambda x, w, b: layer_norm(x.cos(), w, b) * 3
    else:
        offsets = torch.tensor([0, 5, 5, 17])
        inputs = (rand(17, 12), rand(3, 12, 9))
        fn = lambda a, b: grouped_matmul(a.relu(), b, offsets).sigmoid()

    def run(f):
        for t in inputs:
            t.grad = None
        out = f(*inputs)
        out.sum().backward()
        return out.detach(), [t.grad.clone() for t in inputs]

    want_out, want_grads = run(fn)
    _reset()
    got_out, got_grads = run(torch.compile(fn, backend="aot_eager"))
    torch.testing.assert_close(got_out, want_out, **TOL)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, **TOL)


def _grads_of(fn, inputs):
    for t in inputs:
        t.grad = None
    loss = fn(*inputs)
    loss.backward()
    return [loss.detach(), *(t.grad.clone() for t in inputs)]


def _compiles_whole_like_eager(fn, inputs, **tol):
    """``fn(*inputs)``'s loss and input gradients compiled with fullgraph=True (aot_eager) equal the eager ones
    (``tol``: assert_close's tolerances, TOL by default)."""
    want = _grads_of(fn, inputs)
    _reset()
    got = _grads_of(torch.compile(fn, backend="aot_eager", fullgraph=True), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **(tol or TOL))


def _leaves(*shapes, seed=11):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen).requires_grad_() for shape in shapes]


ATTENTION_CASES = {
    "gqa-causal": (dict(causal=True), (2, 4, 19, 16), (2, 2, 19, 16)),
    "mha-full-lse": (dict(return_lse=True), (1, 2, 13, 32), (1, 2, 21, 32)),
    "window-softcap": (dict(causal=True, window=5, softcap=3.0), (2, 4, 19, 16), (2, 1, 19, 16)),
    "decode-split": (dict(causal=True, num_splits=4), (2, 4, 1, 16), (2, 2, 70, 16)),
    "atomic-dq": (dict(causal=True, deterministic=False, scale=0.3), (1, 2, 37, 16), (1, 2, 37, 16)),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_flash_attention_compiles_whole(seed, case):
    """No graph break (fullgraph): the forward and the backward are one graph node each."""
    kw, q_shape, kv_shape = ATTENTION_CASES[case]
    inputs = _leaves(q_shape, kv_shape, kv_shape)

    def fn(q, k, v):
        res = flash_attention(q.sin(), k, v * 0.5, **kw)
        out, lse = res if kw.get("return_lse") else (res, None)
        return out.square().sum() + (0 if lse is None else 0.1 * lse.sum())

    _compiles_whole_like_eager(fn, inputs, rtol=1e-5, atol=1e-5)


def test_norms_compile_whole(seed):
    x, w, b = _leaves((3, 7, 40), (40,), (40,))

    def fn(x, w, b):
        rows = x.transpose(0, 1) + 1  # rows that are not contiguous
        return rms_norm(rows, w).exp().sum() + layer_norm(x.cos(), w, b).square().sum() + layer_norm(x[:, ::2], w).sum()

    _compiles_whole_like_eager(fn, (x, w, b))


def test_matmul_compiles_whole(seed):
    """Without ``out``: the bias and activation epilogue, a transposed operand, and a frozen weight (no grad)."""
    a, b, bias = _leaves((13, 24), (24, 10), (10,))
    frozen = torch.randn(10, 7)

    def fn(a, b, bias):
        h = matmul(a * 2, b.t().contiguous().t(), bias, "gelu")
        return matmul(h, frozen).tanh().sum() + matmul(h, b.t()[:, :5], activation="silu").sum()

    _compiles_whole_like_eager(fn, (a, b, bias))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_matmul_into_a_buffer_compiles_whole_without_gradients(seed, backend):
    """``out=`` (a row block of a larger buffer, written and accumulated onto, with and without the epilogue) in
    code that needs no gradient: one in-place operator node per call, the buffer left as the eager calls leave
    it, its other rows untouched."""
    gen = torch.Generator().manual_seed(seed)
    a, b, bias = torch.randn(5, 7, generator=gen), torch.randn(7, 9, generator=gen), torch.randn(9, generator=gen)
    buf = torch.randn(16, 9, generator=gen)

    def fn(a, b, bias, buf):
        y = matmul(a, b, bias, activation="gelu", out=buf[2:7])
        matmul(a * 2, b.t().contiguous().t(), out=buf[9:14], accumulate=True)
        return y.sum() + buf[0].sum()

    want_buf = buf.clone()
    with torch.no_grad():
        want = fn(a, b, bias, want_buf)
        _reset()
        got_buf = buf.clone()
        got = torch.compile(fn, backend=backend, fullgraph=True)(a, b, bias, got_buf)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_buf, want_buf, **TOL)


def test_compiled_matmul_into_memory_of_its_input_is_never_wrong(seed):
    """``out`` overlapping ``a`` is refused eagerly. A graph writes functionally (the product of the inputs as they
    were), but inductor may turn the write back in place, where the kernel would read rows it already wrote: the
    operator checks the memory when it runs and raises eager's error there. So a compiled call gives the
    functional result or that error, never a wrong buffer."""
    b = torch.randn(7, 9, generator=torch.Generator().manual_seed(seed))

    def fn(buf, b):
        matmul(buf[3:8, :7], b, out=buf[0:5])
        return buf

    buf = torch.randn(20, 9, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad(), pytest.raises(ValueError, match="out must not share memory with a"):
        fn(buf.clone(), b)
    want = buf.clone()
    want[0:5] = buf[3:8, :7] @ b
    for backend in ("aot_eager", "inductor"):
        _reset()
        with torch.no_grad():
            try:
                got = torch.compile(fn, backend=backend, fullgraph=True)(buf.clone(), b)
            except ValueError as error:
                assert "out must not share memory with a" in str(error), (backend, error)
                continue
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, backend=backend: f"{backend}: {m}")


def test_custom_operators_pass_torchs_checks(seed):
    """torch.library.opcheck: schema, fake implementations against real outputs (shapes, strides, dtypes),
    the autograd registration, and AOTAutograd's dispatch, static and dynamic."""
    q, k, v = _leaves((2, 4, 19, 16), (2, 2, 19, 16), (2, 2, 19, 16))
    torch.library.opcheck(flash_attention_op, (q, k, v, True, 0.25, None, None, None, True))
    t = q.detach().transpose(1, 2).requires_grad_()  # a [B, S, H, D] layout: out follows it
    torch.library.opcheck(flash_attention_op, (t, k.transpose(1, 2), v.transpose(1, 2), False, 0.3, 2, None, 2.0, True))
    tables = _self_segment_bounds(torch.tensor([[0] * 7 + [1] * 12, [2] * 19]))  # packed documents
    torch.library.opcheck(flash_attention_op, (q, k, v, True, 0.25, None, 5, None, True, *tables))
    x, w, b = _leaves((3, 7, 40), (40,), (40,))
    torch.library.opcheck(norm_op, (x, w, None, 1e-6, True))
    torch.library.opcheck(norm_op, (x.transpose(0, 1), w, b, 1e-5, False))
    a, m = _leaves((13, 24), (24, 10))
    torch.library.opcheck(matmul_op, (a, m, b[:10], "silu", True))
    torch.library.opcheck(matmul_op, (a, m.t().contiguous().t(), None, None, False))
    rows, experts = _leaves((11, 24), (3, 24, 10))  # grouped: rows 0-3, none, 3-11 for the three experts
    offsets = torch.tensor([0, 3, 3, 11])
    torch.library.opcheck(grouped_matmul_op, (rows, experts, offsets))
    torch.library.opcheck(grouped_matmul_op, (rows, experts.detach().transpose(1, 2).contiguous().transpose(1, 2),
                                              offsets))  # fmt: skip
    buf = torch.randn(20, 10)  # matmul_into writes into (or adds onto) a row block of it
    torch.library.opcheck(matmul_into_op, (a.detach(), m.detach(), b[:10].detach(), "gelu", buf[3:16], False))
    torch.library.opcheck(matmul_into_op, (a.detach(), m.detach(), None, None, buf[5:18], True))


@pytest.mark.parametrize("form", ["one sequence", "pair"])
def test_packed_documents_compile_whole(seed, form):
    """segment_ids enter the graph: their tables are computed in it and passed to the operators, forward and
    backward. One [B, S] tensor (documents packed into each row), or a (q_ids, kv_ids) pair of ids in order."""
    q, k, v = _leaves((2, 4, 17, 16), (2, 2, 17, 16), (2, 2, 17, 16))
    if form == "pair":
        ids = (torch.tensor([[0] * 6 + [2] * 11, [1] * 17]), torch.tensor([[0] * 9 + [2] * 8, [0] * 4 + [1] * 13]))
    else:
        ids = torch.tensor([[0] * 6 + [1] * 11, [3] * 5 + [0] * 7 + [3] * 5])
    fn = lambda q, k, v: flash_attention(q, k, v, causal=form != "pair", segment_ids=ids).square().sum()
    _compiles_whole_like_eager(fn, (q, k, v))


def test_compiled_attention_still_refuses_segment_ids_out_of_order():
    """Under compile the order of a pair's ids is checked on the device (eagerly, on the host)."""
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    fn = torch.compile(lambda q, k, v, ids: flash_attention(q, k, v, segment_ids=ids), backend="aot_eager",
                       fullgraph=True)  # fmt: skip
    ordered = torch.tensor([[0] * 4 + [1] * 4])
    fn(q, k, v, (ordered, ordered))
    with pytest.raises(RuntimeError, match=r"segment_ids\[1\] must be non-negative ids below 2\*\*31, non-decreasing"):
        fn(q, k, v, (ordered, ordered.flip(1)))


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_hf_llama_with_tessels_attention_compiles_whole(seed):
    import transformers

    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, attn_implementation="tessel",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(128, (2, 9), generator=torch.Generator().manual_seed(2))

    def run(f):
        model.zero_grad(set_to_none=True)
        logits = f(ids).logits
        logits.square().sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want = run(model)
    _reset()
    got = run(torch.compile(model, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(got[0], want[0], **TOL)
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_a_top_level_kernels_import_stays_empty():
    """With the repository's root on sys.path, transformers imports this folder as "kernels" while it looks for the
    Hugging Face package of that name; that copy must stay empty, or its custom operators would replace
    tessel.kernels' (and its kernels, its interpreter switch, would be a second set)."""
    code = (
        "import sys, tessel.kernels, transformers.models.llama.modeling_llama, kernels\n"
        "assert kernels.__all__ == [], kernels.__all__\n"
        "print(sorted(m for m in sys.modules if m.startswith('kernels')))"
    )
    root = Path(tessel.kernels.__file__).resolve().parents[1]  # the folder that holds kernels/
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "['kernels']", done.stdout


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU code needs a C++ compiler")
def test_inductor_compiles_a_block_whole(seed):
    """Inductor itself (C++ on the CPU), not just the graph capture: it lays buffers out from the fake
    implementations and calls the operators as external kernels between its own fused code."""
    x, w_qkv, g = _leaves((2, 19, 64), (64, 192), (64,))
    with torch.no_grad():
        w_qkv.mul_(0.1)

    def block(x, w_qkv, g):
        h = rms_norm(x, g)
        qkv = matmul(h.reshape(-1, 64), w_qkv).view(2, 19, 3, 4, 16)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, S, D] views of [B, S, 3, H, D]
        o = flash_attention(q, k, v, causal=True).transpose(1, 2).reshape(2, 19, 64)
        return (x + o).square().mean()

    want = _grads_of(block, (x, w_qkv, g))
    _reset()
    got = _grads_of(torch.compile(block, fullgraph=True), (x, w_qkv, g))
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-6)


def test_gpt_training_step_compiles_whole_on_one_rank(seed):
    """A world of one moves nothing: the collectives return before their opaque transports and the layers'
    input gradients use matmul's operators, so the forward, the loss and the backward form one graph."""
    cfg = _config(n_layer=2)
    model = GPT(cfg)
    _step_compiles_whole(model, *_batch(cfg))


def test_gpt_training_step_on_packed_documents_compiles_whole(seed):
    """Documents packed into rows: the segment tables, the rotary positions restarting at each document and the
    attention's masks all in the one graph."""
    cfg = _config(n_layer=2)
    model = GPT(cfg)
    idx, targets = _batch(cfg)
    _step_compiles_whole(model, idx, targets, segment_ids=torch.tensor([[0] * 4 + [1] * 7, [5] * 3 + [2] * 8]))


def test_compiled_embedding_still_refuses_an_id_out_of_range():
    """Under compile the ids are checked on the device (the eager check reads them on the host)."""
    from tessel.layers.embedding import VocabParallelEmbedding

    emb = VocabParallelEmbedding(10, 8)
    _reset()
    compiled = torch.compile(lambda ids: emb(ids), backend="aot_eager", fullgraph=True)
    assert compiled(torch.tensor([[1, 9]])).shape == (1, 2, 8)
    with pytest.raises(RuntimeError, match=r"must lie in \[0, 10\)"):
        compiled(torch.tensor([[1, 10]]))


def _compiled_tp(rank, world_size, sequence_parallel, overlap, n_kv_head=2):
    from tessel.parallel import record_events

    cfg = _config(n_layer=2, bias=True, n_kv_head=n_kv_head)
    torch.manual_seed(0)
    model = GPT(cfg, sequence_parallel=sequence_parallel, overlap=overlap)
    with record_events() as log:
        loss = _step_compiles_whole(model, *_batch(cfg, s=8))
    dist.barrier()
    return loss.item(), log.events


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world, sequence_parallel, overlap, n_kv_head",
    [(2, False, True, 2), (2, True, True, 2), (2, True, False, 2), (2, False, True, 1), (2, True, True, 1),
     (4, True, True, 2)],
    ids=["tp", "tp+sp", "tp+sp-plain", "tp-kv1", "tp+sp-kv1", "tp4+sp-kv2"],
)  # fmt: skip
def test_compiled_tensor_parallel_gpt_training_step_is_one_graph(world, sequence_parallel, overlap, n_kv_head):
    """Two ranks: the forward, the loss and the backward in one graph (fullgraph); loss and every gradient shard
    equal the eager step's, whose rings run tessel's own transports. With overlap the overlapped ops are custom
    operators whose nodes run those rings: the compiled step logs the same ring steps as the eager one (the log
    holds the eager step's events, then the same again). Without overlap they are their plain compositions
    (torch's functional collectives, scheduled by the compiler), and no ring runs in either. The ranks run the
    kernels' references (they import transformers first, which once imported a second copy of tessel's kernels
    whose custom operators replaced the first's: see test_a_top_level_kernels_import_stays_empty). One kv head over
    the two ranks: each holds a copy in its qkv weight, whose gradients the graph sums; two over four ranks: each copy's
    gradients summed over the two ranks holding it, their own process group's all-reduce in the graph."""
    results = run_ranks(_compiled_tp, world, sequence_parallel, overlap, n_kv_head, timeout=300, env=REFERENCE_KERNELS)
    assert len({loss for loss, _ in results}) == 1
    for rank, (_, events) in enumerate(results):
        ops = {op for _, op, _ in events}
        if not overlap:
            assert events == [], f"rank {rank}: a ring ran without overlap: {sorted(ops)}"
            continue
        rings = (
            {"all_gather_matmul", "all_gather_matmul.backward", "matmul_reduce_scatter",
             "matmul_reduce_scatter.backward"}
            if sequence_parallel
            else {"matmul_all_reduce", "matmul_grad_all_reduce.backward"}
        )  # fmt: skip
        assert rings <= ops, f"rank {rank}: rings run {sorted(ops)}, expected {sorted(rings)}"
        half = len(events) // 2
        assert events[:half] == events[half:], f"rank {rank}: the compiled step's ring steps differ from the eager's"


_EXPERTS = dict(n_expert=4, top_k=2, mlp_hidden=32, aux_loss_coef=0.05, z_loss_coef=0.01)


def test_gpt_with_experts_training_step_compiles_whole_on_one_rank(seed):
    """A mixture of experts without expert parallelism: routing, the grouped GEMMs (``tessel::grouped_matmul``
    and its backward) and the routes' combination in one graph, the auxiliary losses' gradients included."""
    cfg = _config(n_layer=2, **_EXPERTS)
    _step_compiles_whole(GPT(cfg), *_batch(cfg))


def _compiled_tp_experts(rank, world_size, sequence_parallel):
    cfg = _config(n_layer=2, **_EXPERTS)
    torch.manual_seed(0)
    model = GPT(cfg, sequence_parallel=sequence_parallel, overlap=True)
    loss = _step_compiles_whole(model, *_batch(cfg, s=8))
    dist.barrier()
    return loss.item()


@pytest.mark.multiprocess
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_compiled_tensor_parallel_gpt_with_experts_is_one_graph(sequence_parallel):
    """Experts split by features over two tensor-parallel ranks (no expert parallelism, whose token counts are
    read on the host): the training step in one graph, equal to the eager step."""
    losses = run_ranks(_compiled_tp_experts, 2, sequence_parallel, timeout=300, env=REFERENCE_KERNELS)
    assert len(set(losses)) == 1


def _compiled_cp(rank, world_size, documents):
    from tessel.parallel.context import split_sequence

    cfg = _config(n_layer=2, block_size=24)
    torch.manual_seed(0)
    tp_group = dist.new_group([rank])  # every rank its own tensor-parallel group: the two ranks split the sequence
    model = GPT(cfg, tp_group=tp_group, cp_group=dist.group.WORLD)
    idx, targets = _batch(cfg, s=12)
    ids = torch.tensor([[0] * 5 + [1] * 7, [4] * 12]) if documents else None
    local = [split_sequence(t, dist.group.WORLD) for t in (idx, targets)]
    loss = _step_compiles_whole(model, *local, **({"segment_ids": ids} if documents else {}))
    dist.barrier()
    return loss.item()


@pytest.mark.multiprocess
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_compiled_context_parallel_gpt_training_step_is_one_graph(documents):
    """Two ranks splitting each sequence (zigzag): under compile the ring attention takes its all-gather form, so
    the training step is one graph, and its loss and gradients equal the eager ring's."""
    run_ranks(_compiled_cp, 2, documents, timeout=300, env=REFERENCE_KERNELS)


def test_sequence_parallel_gpt_compiles_whole_on_one_rank(seed):
    """At t = 1 the sequence-parallel layers' overlapped ops take their plain composition under compile (the ring
    of a world of one has nothing to exchange, but its in-place launches cannot be in a graph)."""
    cfg = _config(n_layer=2, bias=True)
    model = GPT(cfg, sequence_parallel=True, overlap=True)
    _step_compiles_whole(model, *_batch(cfg))


@pytest.mark.gpu
def test_inductor_compiled_gpt_matches_eager():
    """Inductor on CUDA: the GPT's whole training step in one graph (Triton kernels of inductor's own between
    tessel's operators), bf16 as models train."""
    cfg = _config(n_layer=2, n_embd=128, block_size=64)
    torch.manual_seed(0)
    model = GPT(cfg).cuda().to(torch.bfloat16)
    idx, targets = (t.cuda() for t in _batch(cfg, s=50))
    eager = _loss_and_grads(model, model, idx, targets)
    _reset()
    step = torch.compile(lambda idx, targets: model.loss_from_logits(model(idx), targets), fullgraph=True)
    model.zero_grad(set_to_none=True)
    step(idx, targets).backward()
    for name, want in eager[2].items():
        got = dict(model.named_parameters())[name].grad
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
        assert err < 5e-2, (name, err)  # bf16 rounding in other places: a few ulps of the largest gradient


def _compiled_hf(rank, world_size):
    import transformers

    from tessel.layers.hf import register_hf_attention
    from tessel.layers.parallelize import parallelize

    register_hf_attention()
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, attn_implementation="tessel",
    )  # fmt: skip
    torch.manual_seed(0)
    model = parallelize(transformers.LlamaForCausalLM(config), None, sequence_parallel=True, overlap=True)
    gen = torch.Generator().manual_seed(1)
    ids, weights = torch.randint(128, (2, 8), generator=gen), torch.randn(2, 8, 128, generator=gen)

    def run(fn):
        model.zero_grad(set_to_none=True)
        logits = fn(ids).logits
        (logits * weights[..., : logits.shape[-1]]).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_logits, want_grads = run(model)
    torch._dynamo.reset()
    got_logits, got_grads = run(torch.compile(model, backend="aot_eager", fullgraph=True))

    # AOTAutograd decomposes Hugging Face's own operations (its RMSNorm, softmax, rotary): fp32 reordering, ~1e-6
    # of the largest entry
    def close(got, want, msg=None):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * max(want.abs().max().item(), 1.0), msg=msg)

    close(got_logits, want_logits)
    for name, want in want_grads.items():
        close(got_grads[name], want, msg=lambda m, name=name: f"grad of {name}: {m}")
    dist.barrier()


@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_compiled_parallelized_hf_llama_matches_eager():
    """A Hugging Face Llama, parallelized over two ranks with sequence parallelism and tessel's attention, compiles
    whole."""
    run_ranks(_compiled_hf, 2, timeout=300)

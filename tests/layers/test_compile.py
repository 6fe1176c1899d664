"""``torch.compile`` over tessel: kernels, the reference GPT, and the tensor-parallel GPT on gloo ranks.

tessel's launchers and collectives are opaque to Dynamo (``kernels._dispatch.opaque_to_compile``): a compiled
model breaks its graph around each kernel and collective, runs them as it does without compile, and
compiles what lies between (embeddings, rotary tables, residual additions, the loss). Each test runs a
model or an op eagerly and compiled from the same weights and inputs and checks that outputs and every
gradient agree. ``aot_eager`` traces forward and backward through AOTAutograd, as inductor does, without
generating code, so the CPU runs stay short; the GPU test uses inductor itself.

Without the opaque launchers Dynamo traces into Triton's host code: on a CPU it walks the interpreter's
NumPy emulation of each program and fails.
"""

import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

from tessel.kernels import flash_attention, grouped_matmul, layer_norm, matmul, rms_norm
from tessel.layers.gpt import GPT, GPTConfig
from tests.multiprocess import run_ranks

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


def _compiled_tp(rank, world_size, sequence_parallel):
    cfg = _config()
    torch.manual_seed(0)
    model = GPT(cfg, sequence_parallel=sequence_parallel, overlap=True)
    idx, targets = _batch(cfg, s=8)
    eager = _loss_and_grads(model, model, idx, targets)
    torch._dynamo.reset()
    compiled = _loss_and_grads(model, torch.compile(model, backend="aot_eager"), idx, targets)
    _compare(eager, compiled)
    dist.barrier()
    return compiled[1].item()


@pytest.mark.multiprocess
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_compiled_tensor_parallel_gpt_matches_eager(sequence_parallel):
    """Two ranks: the overlapped rings and the collectives run between the compiled pieces, in the same
    order on every rank."""
    losses = run_ranks(_compiled_tp, 2, sequence_parallel, timeout=300)
    assert len(set(losses)) == 1


@pytest.mark.gpu
def test_inductor_compiled_gpt_matches_eager():
    cfg = _config(n_layer=2, n_embd=128, block_size=64)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    idx, targets = (t.cuda() for t in _batch(cfg, s=50))
    eager = _loss_and_grads(model, model, idx, targets)
    _reset()
    compiled = _loss_and_grads(model, torch.compile(model), idx, targets)
    for want, got in zip(eager[:2], compiled[:2]):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-4)
    for name, want in eager[2].items():
        torch.testing.assert_close(compiled[2][name], want, rtol=2e-3, atol=2e-4, msg=lambda m, n=name: f"{n}: {m}")


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
    got_logits, got_grads = run(torch.compile(model, backend="aot_eager"))

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
    """A Hugging Face Llama, parallelized over two ranks with sequence parallelism and tessel's attention."""
    run_ranks(_compiled_hf, 2, timeout=300)

"""``launch_tuned``: the same launches as Triton's autotuner, without its per-call lookup once a key is tuned.

No GPU is needed: the JIT function's ``run`` (the compiled kernel's launch) and the autotuner's timing are
replaced by recorders, so what is checked is what reaches the launch: the arguments, the picked
configuration's meta-parameters and launch options, the grid, and that tuning, pre-hooks and swapped
configuration lists still go through ``Autotuner.run``.
"""

import importlib

import pytest
import torch
import triton
import triton.language as tl

from tessel.kernels import _tuned
from tessel.kernels._dispatch import Backend
from tessel.kernels._tuned import autotuner_key, launch_tuned


@triton.jit
def _toy_kernel(x_ptr, y_ptr, M, N, scale, stride_x, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    pass


_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w, num_stages=s) for b, w, s in ((16, 4, 2), (32, 8, 3), (64, 4, 4))]


def _recording(tuned, monkeypatch, best=1):
    """Record every launch reaching the JIT function and every ``Autotuner.run``; the timed tuning picks
    configuration ``best``."""
    launches, runs = [], []
    monkeypatch.setattr(tuned.fn, "run", lambda *args, **kwargs: launches.append((args, kwargs)))
    timing = lambda *args, config, **kwargs: [0.0 if config is tuned.configs[best] else 1.0]
    monkeypatch.setattr(tuned, "_bench", timing)
    autotuner_run = type(tuned).run
    monkeypatch.setattr(tuned, "run", lambda *args, **kwargs: (runs.append(1), autotuner_run(tuned, *args, **kwargs)))
    return launches, runs


def _described(x):
    """A launch argument as the kernel sees it: a tensor by its memory and layout."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.data_ptr(), x.shape, x.stride(), x.dtype)
    return x


def _toy(monkeypatch, **kw):
    tuned = triton.autotune(configs=list(_CONFIGS), key=["M", "FLAG"], **kw)(_toy_kernel)
    return tuned, *_recording(tuned, monkeypatch)


def _args(m=48, dtype=torch.float16):
    x, y = torch.zeros(4, dtype=dtype), torch.zeros(4, dtype=torch.float32)
    return (x, y, m, 7, 0.5, 1)


def test_a_tuned_key_launches_like_the_autotuner_without_its_lookup(monkeypatch):
    tuned, launches, runs = _toy(monkeypatch)
    grid = lambda meta: (triton.cdiv(48, meta["BLOCK"]),)
    args, flags = _args(), {"FLAG": True}
    launch_tuned(tuned, grid, args, flags)  # not tuned yet: the autotuner tunes, then launches
    assert len(runs) == 1 and list(tuned.cache.values()) == [tuned.configs[1]]
    assert autotuner_key(tuned, args, flags) in tuned.cache  # the key as the autotuner computed it
    launch_tuned(tuned, grid, args, flags)  # tuned: straight to the JIT function
    assert len(runs) == 1
    tuned[grid](*args, **flags)  # the autotuner's own launch, for comparison
    assert len(runs) == 2
    fast, slow = launches[-2], launches[-1]
    assert fast[0] == slow[0]
    assert fast[1] == slow[1] == {**flags, "grid": grid, "warmup": False, "BLOCK": 32, "num_warps": 8, "num_ctas": 1,
                                  "num_stages": 3}  # fmt: skip
    assert tuned.best_config is tuned.configs[1]


def test_another_key_or_dtype_is_tuned_by_the_autotuner(monkeypatch):
    tuned, launches, runs = _toy(monkeypatch)
    grid = (1,)
    for args, flags in [(_args(), {"FLAG": True}), (_args(m=64), {"FLAG": True}), (_args(), {"FLAG": False}),
                        (_args(dtype=torch.bfloat16), {"FLAG": True})]:  # fmt: skip
        launch_tuned(tuned, grid, args, flags)
    assert len(runs) == 4 and len(tuned.cache) == 4  # each a key of its own
    assert set(tuned.cache) == {
        autotuner_key(tuned, args, flags)
        for args, flags in [(_args(), {"FLAG": True}), (_args(m=64), {"FLAG": True}), (_args(), {"FLAG": False}),
                            (_args(dtype=torch.bfloat16), {"FLAG": True})]
    }  # fmt: skip
    launch_tuned(tuned, grid, _args(m=64), {"FLAG": True})
    assert len(runs) == 4 and len(launches) == 5


def test_swapped_configurations_and_cleared_cache_are_seen(monkeypatch):
    """A tile sweep (bench/attention_tiles.py) sets one configuration and an empty cache at a time."""
    tuned, launches, runs = _toy(monkeypatch)
    args, flags = _args(), {"FLAG": True}
    launch_tuned(tuned, (1,), args, flags)
    for config in _CONFIGS:
        tuned.configs, tuned.cache = [config], {}
        launch_tuned(tuned, (1,), args, flags)
        assert launches[-1][1]["BLOCK"] == config.kwargs["BLOCK"] and tuned.best_config is config
    tuned.configs, tuned.cache = list(_CONFIGS), {}
    launch_tuned(tuned, (1,), args, flags)
    assert len(runs) == 2  # the emptied cache tunes again


def test_a_configuration_with_a_pre_hook_keeps_the_autotuner(monkeypatch):
    hooked = []
    tuned, _, runs = _toy(monkeypatch)
    for config in tuned.configs:
        config.pre_hook = lambda nargs: hooked.append(nargs["M"])
    try:
        for _ in range(3):
            launch_tuned(tuned, (1,), _args(), {"FLAG": True})
    finally:
        for config in tuned.configs:
            config.pre_hook = None
    assert len(runs) == 3 and hooked == [48, 48, 48]


def test_every_tessel_autotuner_keys_on_arguments_its_launches_pass():
    """The key slots resolve for each of tessel's autotuned kernels (a key name the kernel lacks would fail)."""
    mm = importlib.import_module("tessel.kernels.matmul")
    att = importlib.import_module("tessel.kernels.attention_kernels")
    gm = importlib.import_module("tessel.kernels.grouped_matmul")
    kernels = [mm._matmul_kernel_tuned, gm._grouped_tuned, gm._wgrad_tuned, att.split_kv_kernel_tuned]
    for kernel in kernels + list(att._TUNED.values()):
        slots = _tuned._key_slots(kernel)
        assert [kernel.arg_names[i] for i in slots] == list(kernel.keys)


def test_matmul_launches_the_same_kernel_call_fast_and_through_the_autotuner(monkeypatch):
    """tessel's GEMM launcher on the CUDA path (the device parts replaced): the second call of a shape skips
    ``Autotuner.run`` and passes the JIT function exactly what the autotuner passed for the first."""
    mm = importlib.import_module("tessel.kernels.matmul")
    tuned = mm._matmul_kernel_tuned
    monkeypatch.setattr(tuned, "cache", {})
    launches, runs = _recording(tuned, monkeypatch, best=0)
    monkeypatch.setattr(mm, "backend_for", lambda *tensors: Backend.TRITON)
    monkeypatch.setattr(mm, "_ensure_scratch_allocator", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    a, w = torch.randn(40, 24, dtype=torch.bfloat16), torch.randn(56, 24, dtype=torch.bfloat16)
    out = torch.empty(80, 56, dtype=torch.bfloat16)
    for _ in range(2):
        mm.matmul_unchecked(a, w.t(), out=out[40:])
    assert len(runs) == 1 and len(launches) == 2
    (args0, kw0), (args1, kw1) = launches
    assert [_described(x) for x in args0] == [_described(x) for x in args1] and kw0.keys() == kw1.keys()
    grid0, grid1 = kw0.pop("grid"), kw1.pop("grid")
    assert kw0 == kw1 and grid0(kw0) == grid1(kw1)
    assert kw0["BLOCK_M"] == tuned.configs[0].kwargs["BLOCK_M"]


@pytest.mark.gpu
def test_gpu_second_launches_skip_the_autotuner_and_compute_the_same(monkeypatch):
    """On CUDA every tessel GEMM, attention and expert GEMM launch goes through ``launch_tuned``: after the first
    launch of a shape the autotuner is not asked again, and the results are bit-identical to the first's."""
    mm = importlib.import_module("tessel.kernels.matmul")
    att = importlib.import_module("tessel.kernels.attention_kernels")
    from tessel.kernels import flash_attention

    runs = []
    for tuned in (mm._matmul_kernel_tuned, att.fwd_kernel_tuned, att.dkdv_kernel_tuned, att.dq_kernel_tuned):
        autotuner_run = type(tuned).run
        counted = lambda *a, tuned=tuned, run=autotuner_run, **kw: (runs.append(tuned), run(tuned, *a, **kw))
        monkeypatch.setattr(tuned, "run", counted)
    a = torch.randn(1000 + 7, 512 + 3, device="cuda", dtype=torch.bfloat16)  # shapes no other test tunes for
    b = torch.randn(512 + 3, 768 + 5, device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(2, 4, 333, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    results, tunings = [], []
    for _ in range(2):
        out = mm.matmul(a, b)
        o = flash_attention(q, k, v, causal=True)
        grads = torch.autograd.grad(o.float().square().sum(), (q, k, v))
        results.append((out, o, *grads))
        tunings.append(len(runs))
    assert tunings[0] <= 4 and tunings[1] == tunings[0]  # at most one tuning launch each, none the second time
    for first, second in zip(*results):
        assert torch.equal(first, second)

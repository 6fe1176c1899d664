"""The GEMM's persistent and TMA-descriptor programs against float64, and how the launcher picks them.

On a GPU the autotuner chooses among plain, persistent and TMA programs by measuring them; under
the interpreter a test picks the variant (``_INTERPRETER_VARIANT``), and a spy on the kernel records
the meta-parameters and the grid of every launch, so each test proves which program produced the
numbers it checks.
"""

import collections
import importlib
import threading

import pytest
import torch

from tessel.kernels import matmul

from .test_matmul import assert_gemm_close, make, reference

matmul_module = importlib.import_module("tessel.kernels.matmul")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VARIANTS = {
    "persistent": {"PERSISTENT": True, "TMA": False},
    "tma": {"PERSISTENT": False, "TMA": True},
    "tma+persistent": {"PERSISTENT": True, "TMA": True},
}
# Every dimension a multiple of 8 (16-byte rows in every dtype, so TMA applies) but not of the
# interpreter's 32-wide blocks: edges are zero-filled by the descriptors, never masked.
ALIGNED = (72, 56, 40)  # M, N, K
# No dimension a multiple of 8: TMA cannot apply and the pointer loads take over.
ODD = (37, 53, 29)


@pytest.fixture
def launches(monkeypatch):
    """Records (meta, grid) of every interpreter launch of the GEMM kernel."""
    kernel = matmul_module._matmul_kernel
    seen = []

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append((dict(kwargs), tuple(grid)))
                return kernel[grid](*args, **kwargs)

            return run

    monkeypatch.setattr(matmul_module, "_matmul_kernel", Spy())
    return seen


@pytest.fixture(params=list(VARIANTS))
def variant(request, monkeypatch):
    monkeypatch.setattr(matmul_module, "_INTERPRETER_VARIANT", VARIANTS[request.param])
    return VARIANTS[request.param]


def tiles(m, n):
    block = matmul_module._INTERPRETER_BLOCKS
    return -(-m // block["BLOCK_M"]) * -(-n // block["BLOCK_N"])


def check_launch(record, variant, m, n, tma_expected):
    meta, grid = record
    assert meta["TMA"] is tma_expected
    assert meta["PERSISTENT"] is variant["PERSISTENT"]
    if variant["PERSISTENT"]:  # fewer programs than tiles: each program walks several
        assert grid == (min(tiles(m, n), matmul_module._INTERPRETER_PROGRAMS),)
    else:
        assert grid == (tiles(m, n),)


# ---------------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
def test_forward_layouts(seed, launches, variant, dtype, ta, tb):
    m, n, k = ALIGNED
    a, b = make((m, k), dtype, ta), make((k, n), dtype, tb)
    bias = torch.randn(n, dtype=dtype)
    out = matmul(a, b, bias, "gelu")
    assert_gemm_close(out, *reference(a, b, bias, "gelu"), dtype)
    assert len(launches) == 1
    check_launch(launches[0], variant, m, n, tma_expected=variant["TMA"])
    assert launches[0][0]["A_T"] is ta and launches[0][0]["B_T"] is tb


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_operands_fall_back_to_pointer_loads(seed, launches, variant, dtype):
    m, n, k = ODD
    a, b = make((m, k), dtype), make((k, n), dtype, True)
    assert_gemm_close(matmul(a, b), *reference(a, b), dtype)
    check_launch(launches[0], variant, m, n, tma_expected=False)


def test_misaligned_base_falls_back(seed, launches, variant):
    """A view starting one element into its storage: its base is not 16-byte aligned."""
    m, n, k = ALIGNED
    a = torch.randn(m * k + 1)[1:].view(m, k)
    b = make((k, n), torch.float32)
    assert_gemm_close(matmul(a, b), *reference(a, b), torch.float32)
    check_launch(launches[0], variant, m, n, tma_expected=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_into_a_block_of_a_nan_buffer(seed, launches, variant, dtype):
    """The epilogue of every variant writes only its own block, and adds onto it in place."""
    m, n, k = ALIGNED
    buf = torch.full((m + 9, n + 8), float("nan"), dtype=dtype)
    out = buf[3 : 3 + m, 4 : 4 + n]
    prev = torch.randn(m, n, dtype=dtype)
    out.copy_(prev)
    a, b = make((m, k), dtype), make((k, n), dtype)
    matmul(a, b, out=out, accumulate=True)
    want, mag = reference(a, b)
    assert_gemm_close(out, want + prev.double(), mag + prev.double().abs(), dtype)
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[3 : 3 + m, 4 : 4 + n] = False
    assert buf[outside].isnan().all()
    check_launch(launches[0], variant, m, n, tma_expected=variant["TMA"])


def test_persistent_programs_cover_many_tiles(seed, launches, monkeypatch):
    """15 tiles over 3 programs: every program runs 5 of them, in grouped order, none twice."""
    monkeypatch.setattr(matmul_module, "_INTERPRETER_VARIANT", VARIANTS["persistent"])
    m, n, k = 130, 70, 45  # 5 x 3 tiles of 32 x 32
    a, b = make((m, k), torch.float32), make((k, n), torch.float32)
    out = torch.full((m, n), float("nan"))
    matmul(a, b, out=out)
    assert launches[0][1] == (3,) and tiles(m, n) == 15
    assert_gemm_close(out, *reference(a, b), torch.float32)


# ---------------------------------------------------------------------------------------------------- backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_reads_transposes_through_descriptors(seed, launches, monkeypatch, dtype):
    """dA = dZ·Bᵀ and dB = Aᵀ·dZ read b and a through their transposes: the A_T/B_T descriptors."""
    monkeypatch.setattr(matmul_module, "_INTERPRETER_VARIANT", VARIANTS["tma+persistent"])
    m, n, k = ALIGNED
    a = make((m, k), dtype).requires_grad_()
    b = make((k, n), dtype).requires_grad_()
    bias = torch.randn(n, dtype=dtype, requires_grad=True)
    out = matmul(a, b, bias, "silu")
    grad = torch.randn_like(out)
    out.backward(grad)

    a64, b64, bias64 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    ref = matmul_module.matmul_reference(a64, b64, bias64, "silu")
    ref.backward(grad.double())
    g = grad.double().abs()
    assert_gemm_close(a.grad, a64.grad, 1.2 * g @ b64.detach().abs().t(), dtype)
    assert_gemm_close(b.grad, b64.grad, 1.2 * a64.detach().abs().t() @ g, dtype)
    metas = [meta for meta, _ in launches]
    assert [(x["TMA"], x["A_T"], x["B_T"]) for x in metas] == [
        (True, False, False),  # forward
        (True, False, True),  # dA: b.t() is read through b's rows
        (True, True, False),  # dB: a.t() is read through a's rows
    ]


# ---------------------------------------------------------------------------------------------------- host side


def test_program_names(launches, monkeypatch):
    describe = matmul_module.describe_program
    meta = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "PERSISTENT": True, "TMA": True}
    assert describe(meta, 8, 3) == "128x256x64 persistent+tma w8 s3"
    assert describe({**meta, "PERSISTENT": False, "TMA": False}) == "128x256x64 tiles"
    monkeypatch.setattr(matmul_module, "_INTERPRETER_VARIANT", VARIANTS["persistent"])
    monkeypatch.setattr(matmul_module, "_interpreter_program", {})
    matmul(torch.randn(40, 40), torch.randn(40, 40))
    assert matmul_module.last_program() == "32x32x32 persistent (interpreter)"


def test_tma_layout():
    layout = matmul_module._tma_layout
    assert layout(torch.empty(8, 40)) is False  # rows contiguous
    assert layout(torch.empty(40, 8).t()) is True  # columns contiguous: read through the transpose
    assert layout(torch.empty(8, 40, dtype=torch.float16)) is False
    assert layout(torch.empty(8, 36, dtype=torch.float16)) is None  # 72-byte rows
    assert layout(torch.empty(8, 41)) is None  # 164-byte rows
    assert layout(torch.empty(16, 80)[::2, ::2]) is None  # no unit stride
    assert layout(torch.empty(8 * 40 + 1)[1:].view(8, 40)) is None  # base off by 4 bytes


def test_tma_needs_hopper_or_the_interpreter():
    a, b = torch.empty(8, 40), torch.empty(40, 8)
    assert matmul_module._tma_flags(a, b, "interpreter")["TMA_OK"]
    assert not matmul_module._tma_flags(a, b, "reference")["TMA_OK"]
    assert not matmul_module._tma_flags(a, torch.empty(40, 9), "interpreter")["TMA_OK"]


def test_tuning_space_holds_every_variant():
    variants = {(c.kwargs["PERSISTENT"], c.kwargs["TMA"]) for c in matmul_module._hopper_configs()}
    assert variants == {(False, False), (True, False), (False, True), (True, True)}


def test_prune_drops_what_cannot_help():
    configs = matmul_module._hopper_configs()
    cpu = torch.empty(1)  # _num_sms of a CPU tensor is the interpreter's program count (3)

    def kept(m, n, tma_ok):
        pruned = matmul_module._prune_configs(configs, {"a_ptr": cpu, "M": m, "N": n}, TMA_OK=tma_ok)
        return {(c.kwargs["PERSISTENT"], c.kwargs["TMA"]) for c in pruned}

    assert kept(4096, 4096, True) == {(False, False), (True, False), (False, True), (True, True)}
    assert kept(4096, 4096, False) == {(False, False), (True, False)}
    assert kept(128, 128, True) == {(False, False), (False, True)}  # ≤ one wave: no persistent loop
    assert kept(128, 128, False) == {(False, False)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_prune_drops_pipelines_that_overflow_shared_memory(dtype):
    configs = matmul_module._hopper_configs()
    a = torch.empty(1, dtype=dtype)
    kept = matmul_module._prune_configs(configs, {"a_ptr": a, "M": 4096, "N": 4096}, TMA_OK=True)
    limit = matmul_module._SM90_SHARED_BYTES

    def shared(c):
        return matmul_module._shared_bytes(c.kwargs, c.num_stages, a.element_size())

    assert kept and all(shared(c) + matmul_module._SHARED_SLACK <= limit for c in kept)
    configs = [c for c in configs if matmul_module.fits_element(c.kwargs, a.element_size())]
    too_big = [c for c in configs if shared(c) + matmul_module._SHARED_SLACK > limit]
    if dtype == torch.float32:  # 128x256x64 in 3 stages needs 288 KiB of fp32
        assert too_big and not any(c in kept for c in too_big)
    else:
        assert not too_big  # every 16-bit tile fits


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float8_e4m3fn])
def test_deep_k_blocks_are_tuned_for_fp8_operands_alone(dtype):
    """fp8 tiles read 128-deep K blocks (the bytes of a 64-deep 16-bit block); wider operands never try them."""
    a = torch.empty(1, dtype=dtype)
    kept = matmul_module._prune_configs(matmul_module._hopper_configs(), {"a_ptr": a, "M": 4096, "N": 4096},
                                        TMA_OK=True)  # fmt: skip
    depths = {c.kwargs["BLOCK_K"] for c in kept}
    assert (128 in depths) == (dtype == torch.float8_e4m3fn) and 64 in depths


def test_scratch_allocator_fills_in_only_where_none_is_set():
    from triton.runtime._allocation import NullAllocator, _allocator

    def user_allocator(size, alignment, stream):  # pragma: no cover - never called on a CPU
        raise AssertionError

    results = {}

    def fresh_thread():  # a new thread starts with Triton's default: no allocator
        results["before"] = isinstance(_allocator.get(), NullAllocator)
        matmul_module._ensure_scratch_allocator()
        results["ours"] = _allocator.get() is matmul_module._scratch

    def user_thread():
        _allocator.set(user_allocator)
        matmul_module._ensure_scratch_allocator()
        results["kept"] = _allocator.get() is user_allocator

    for target in (fresh_thread, user_thread):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert results == {"before": True, "ours": True, "kept": True}


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True)])
def test_gpu_every_program_variant(seed, dtype, ta, tb):
    """Each variant compiled for the GPU (two tile shapes each), launched directly, against float64."""
    m, n, k = 3000, 1000, 1064  # TMA-aligned in every dtype, no dimension a multiple of a tile
    a, b = make((m, k), dtype, ta).cuda(), make((k, n), dtype, tb).cuda()
    bias = torch.randn(n, dtype=dtype, device="cuda")
    want, mag = reference(a.cpu(), b.cpu(), bias.cpu(), "gelu")
    backend = matmul_module.Backend.TRITON
    flags = {
        "HAS_BIAS": True,
        "ACTIVATION": "gelu",
        "ACCUMULATE": False,
        "STORE_PREACT": False,
        "DOT_FP32": False,
        "INPUT_PRECISION": matmul_module._input_precision(dtype, backend),
        "INDEX_64": False,
        "SCALED": False,
        "SPLIT_ACC": False,
        **matmul_module._tma_flags(a, b, backend),
    }
    assert flags["TMA_OK"] == (torch.cuda.get_device_capability() >= (9, 0))
    matmul_module._ensure_scratch_allocator()
    seen, fitting = collections.Counter(), collections.Counter()
    for config in matmul_module._hopper_configs():
        meta = config.kwargs
        variant = (meta["PERSISTENT"], meta["TMA"])
        if not matmul_module.fits_element(meta, a.element_size()):
            continue  # fp8's deep K blocks
        # The autotuner's prune drops tiles whose pipeline does not fit (fp32 at 128×128×64 in four
        # stages needs 256 KiB); launched directly they would fail with OutOfResources.
        stages = matmul_module._shared_bytes(meta, config.num_stages, a.element_size())
        if stages + matmul_module._SHARED_SLACK > matmul_module._shared_limit(a.device):
            continue
        fitting[variant] += 1
        if (meta["TMA"] and not flags["TMA_OK"]) or seen[variant] == 2:
            continue
        seen[variant] += 1
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        n_tiles = -(-m // meta["BLOCK_M"]) * -(-n // meta["BLOCK_N"])
        grid = (min(n_tiles, matmul_module._num_sms(a.device)),) if meta["PERSISTENT"] else (n_tiles,)
        matmul_module._matmul_kernel[grid](
            a, b, out, bias, out, out, out, m, n, k, *a.stride(), *b.stride(), *out.stride(), *out.stride(),
            **flags, **meta, num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        tol = {torch.bfloat16: 1.6e-2, torch.float32: 2e-3}[dtype]  # fp32 may run as TF32
        err = (out.double().cpu() - want).abs() / (mag + want.abs())
        assert err.max().item() <= tol, (variant, meta, err.max().item())
    want_seen = {v: min(2, n) for v, n in fitting.items() if flags["TMA_OK"] or not v[1]}
    assert dict(seen) == want_seen and len(want_seen) == (4 if flags["TMA_OK"] else 2), (seen, fitting)

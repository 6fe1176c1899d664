"""Every tessel kernel compiles for Hopper (sm_90) through Triton's real compiler, on any machine.

No GPU is needed: Triton lowers to PTX and runs the ptxas it ships with. This catches what the
interpreter cannot (unsupported constructs in compiled code, layouts the compiler rejects, pipelines
that do not fit in shared memory) before a GPU ever runs the kernels, and it checks from the PTX that
the programs use Hopper's machinery: wgmma tensor-core instructions, software-pipelined copies for
pointer loads, TMA copies for descriptor loads. The compiling runs in a subprocess because this test
session imported Triton in interpreter mode.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")
H200_SHARED_BYTES = 232448  # 227 KiB per block on sm_90
ATTENTION_MAIN_LOOPS = (
    "attention fwd", "attention split-kv", "attention dkdv", "attention dkdv atomic-dq", "attention dq",
)  # fmt: skip


def _has_nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:  # pragma: no cover - depends on the Triton build
        return False
    return "nvidia" in backends


pytestmark = [
    pytest.mark.skipif(not _has_nvidia_backend(), reason="this Triton build has no NVIDIA backend"),
    # a cold compile of every program takes ~6-7 minutes of two busy cores, beyond the suite's default timeout
    pytest.mark.timeout(1800),
]


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # torch's and Triton's default; silences a notice
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=1700, check=False
    )
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in records if not r["ok"]]
    assert proc.returncode == 0 and records and not failed, (failed, proc.stderr[-4000:])
    return {r["name"]: r for r in records}


def test_every_kernel_compiles_and_fits_in_shared_memory(compiled):
    kernels = {r["kernel"] for r in compiled.values()}
    assert kernels == {
        "matmul", "attention fwd", "attention split-kv", "attention combine", "attention dkdv",
        "attention dkdv atomic-dq", "attention dq",
        "attention preprocess", "adam", "adam stats", "norm fwd", "norm bwd", "grouped matmul",
        "grouped matmul wgrad", "fp8 quantize", "gated matmul", "cross entropy stats", "cross entropy grad",
    }  # fmt: skip
    for name, record in compiled.items():
        assert record["shared"] > 0 or record["kernel"] == "cross entropy grad", name  # that one reduces nothing
        if not record.get("coverage"):  # the specialisations below may hold tiles the autotuner skips
            assert record["shared"] <= H200_SHARED_BYTES, name


def test_every_attention_specialisation_has_a_configuration_that_fits_without_spilling(compiled):
    """fp32 at D=128 (where tiles are twice as large), fp16 at D=64, bf16 at D=16: for each kernel the
    autotuner has a configuration within the shared memory of one block that keeps its registers."""
    groups = {}
    for r in compiled.values():
        if r.get("coverage") and not any(r.get(f) for f in ("segments", "window", "softcap", "wide")):
            groups.setdefault((r["kernel"], r["dtype"], r["head_dim"]), []).append(r)
    kernels = ("attention fwd", "attention split-kv", "attention dkdv", "attention dkdv atomic-dq", "attention dq")
    assert set(groups) == {(k, d, h) for k in kernels for d, h in (("fp32", 128), ("fp16", 64), ("bf16", 16))}
    for key, records in groups.items():
        fitting = [r for r in records if r["shared"] <= H200_SHARED_BYTES and r["spill_bytes"] == 0]
        assert fitting, (key, [(r["name"], r["shared"], r["spill_bytes"]) for r in records])
        assert all(r["wgmma"] + r["mma"] > 0 for r in records), key  # tensor cores in every dtype


@pytest.mark.parametrize("kernel", ATTENTION_MAIN_LOOPS)
def test_head_dim_256_has_a_tile_that_fits_and_keeps_its_registers(compiled, kernel):
    """At D=256 (bf16, causal) the two smallest tiles of each kernel use tensor cores, and one of them fits in the
    shared memory of a block with its main loop free of local-memory traffic; the one-kernel backward, which holds
    dS·K beside the dK and dV accumulators, refills a few registers per step at best (7 at 16×32)."""
    configs = [r for r in compiled.values() if r["kernel"] == kernel and r.get("wide")]
    assert len(configs) == 2, kernel
    report = [(r["name"], r["shared"], r["spill_bytes"], r["loop_local_ops"]) for r in configs]
    assert all(r["wgmma"] + r["mma"] > 0 for r in configs), report
    fitting = [r for r in configs if r["shared"] <= H200_SHARED_BYTES]
    assert fitting, report
    limit = 16 if kernel == "attention dkdv atomic-dq" else 0
    assert min(r["loop_local_ops"] for r in fitting) <= limit, report


def test_gemm_programs_use_tensor_cores_and_pipelines(compiled):
    matmuls = {n: r for n, r in compiled.items() if r["kernel"] == "matmul"}
    assert len(matmuls) == 12
    for name, r in matmuls.items():
        assert r["wgmma"] > 0, name  # Hopper's warpgroup MMA, in fp32 (as TF32) too
        if "tma" in name:
            assert r["tma"] > 0 and r["cp_async"] == 0, name  # operands arrive by TMA only
        else:
            assert r["cp_async"] > 0 and r["tma"] == 0, name
            # Every stage of the software pipeline holds its own A and B blocks: the estimate the
            # autotuner prunes with (kernels/matmul.py _shared_bytes) is what the compiler allocates.
            assert r["shared"] == r["stages"] * r["tile_bytes"], name
        assert r["shared"] >= r["stages"] * r["tile_bytes"], name


def test_every_grouped_gemm_tile_is_pipelined_without_spills(compiled):
    """Every autotuner configuration of the experts' grouped GEMM in bf16, forward and weight gradient (whose wide
    output tiles sum 64 or 128 rows per step), and the fp8 pair: warpgroup MMAs fed by a software pipeline that
    holds every stage's blocks in shared memory (its size the tuner's estimate), and no register spills. The fp8
    weight gradient reads along the tokens from 16-row boundaries, so its loads stay whole vectors and pipeline."""
    grouped = {n: r for n, r in compiled.items() if r["kernel"].startswith("grouped matmul")}
    assert len(grouped) == 16
    for name, r in grouped.items():
        assert r["wgmma"] > 0 and r["cp_async"] > 0 and r["spill_bytes"] == 0, name
        assert r["shared"] == r["stages"] * r["tile_bytes"] <= H200_SHARED_BYTES, name


def test_gated_matmul_waits_with_one_acquire_load_and_keeps_the_gemm_pipeline(compiled):
    """The one-launch GEMM over arriving chunks: its wait for a chunk's flag is one acquire-ordered global load at
    system scope (so rows a peer GPU or a copy engine wrote before the flag are seen; no read-modify-write hammering
    the flag), and its main loop is the plain GEMM's, pipelined, without spills; signalling each finished chunk
    adds one atomic count per tile and one atomic at each chunk's last tile, outside the main loop. Pushing each
    chunk to a destination of its own waits (one acquire load) for the destination's free flag instead of a chunk's
    arrival; with fp8 operands and their scales (products summed per K block) it compiles alike."""
    gated = {n: r for n, r in compiled.items() if r["kernel"] == "gated matmul"}
    assert len(gated) == 5
    for name, r in gated.items():
        assert r["acquire_load"] == 1 and r["sys_acquire_load"] == 1 and r["red"] == 0, name
        # signalling: a tile's count (acq_rel), and the chunk's last tile releases the done flag
        assert r["atom"] == (2 if "signal" in name else 0), name
        assert r["wgmma"] > 0 and r["spill_bytes"] == 0, name
        if "tma" in name:
            assert r["tma"] > 0 and r["cp_async"] == 0, name
        else:
            assert r["cp_async"] > 0 and r["tma"] == 0, name
            assert r["shared"] == r["stages"] * r["tile_bytes"], name


def test_attention_programs_use_tensor_cores_and_pipelines(compiled):
    for name, r in compiled.items():
        if r["kernel"] in ATTENTION_MAIN_LOOPS and not r.get("coverage"):
            assert r["wgmma"] + r["mma"] > 0 and r["cp_async"] > 0, name  # tensor cores, pipelined copies
            rows, cols = (int(x) for x in name.split()[-3].split("x"))  # "... 128x64 w8 s3"
            if min(rows, cols) >= 32:
                assert r["wgmma"] > 0, name  # tiles of 32+ rows and columns use Hopper's warpgroup MMA


def test_only_the_atomic_dq_backward_uses_atomics(compiled):
    """The atomic dQ compiles to fire-and-forget reductions (REDG in the machine code, relaxed: nothing waits for
    an old value; read from the SASS, since Triton 3.6's PTX writes them as ``atom`` with an unused result, which
    ptxas turns into REDG); every other kernel is free of atomics (none in its PTX), but the gated GEMM that counts
    its stored tiles to signal finished chunks (its atomics are checked above)."""
    for name, r in compiled.items():
        if r["kernel"] == "attention dkdv atomic-dq":
            assert r["sass_red"] > 0 and r["sass_atom"] == 0, name
        elif " signal" not in name:
            assert r["red"] == 0 and r["atom"] == 0, name


@pytest.mark.parametrize("kernel", ATTENTION_MAIN_LOOPS)
def test_attention_tuning_holds_a_configuration_that_does_not_spill(compiled, kernel):
    """At D=128 the autotuner can pick a tile whose registers do not spill to local memory (spills
    cost every step of the inner loop a round trip through L1/L2)."""
    configs = [r for r in compiled.values() if r["kernel"] == kernel and not r.get("coverage")]
    assert configs and all(r["head_dim"] == 128 for r in configs)
    assert any(r["spill_bytes"] == 0 for r in configs), [(r["name"], r["spill_bytes"]) for r in configs]


# Local-memory loads and stores per step of a main loop the attention tiles may cost (the FlashAttention-2
# backward tile, 64×128 over 8 warps, refills a few dozen registers per step at bf16, D=128).
ATTENTION_LOOP_LOCAL_OPS = 48


@pytest.mark.parametrize("kernel", ATTENTION_MAIN_LOOPS)
def test_attention_main_loops_keep_their_registers(compiled, kernel):
    """At bf16, D=128 (the benchmark's shapes) no tile the autotuner may pick serialises its warpgroup
    MMAs or spills heavily inside a main loop, and most tiles do not spill there at all. A tile that
    does (e.g. 128 query rows over 4 warps in the forward: hundreds of spilled registers going out
    and back at every step, read from the SASS) costs a large part of the MMA rate, and only slows
    the autotuner down. Every causal tile is compiled; without the mask, the largest and the smallest."""
    plain = [r for r in compiled.values()
             if r["kernel"] == kernel and not r.get("coverage") and not r.get("segments")
             and not r.get("window") and not r.get("softcap")]  # fmt: skip
    causal, full = [r for r in plain if r["causal"]], [r for r in plain if not r["causal"]]
    assert len(causal) >= 6 and len(full) == (0 if kernel == "attention split-kv" else 2), kernel  # decode: causal
    report = [(r["name"], r["loop_local_ops"], r["wgmma_serialized"]) for r in plain]
    assert not any(r["wgmma_serialized"] for r in plain), report
    assert all(r["loop_local_ops"] <= ATTENTION_LOOP_LOCAL_OPS for r in plain), report
    assert 2 * sum(r["loop_local_ops"] == 0 for r in causal) > len(causal), report
    assert not full or full[-1]["loop_local_ops"] == 0, report  # the smallest tile keeps its registers

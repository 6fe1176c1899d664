"""Flash attention's Triton kernels, their block sizes and autotuning; the host side is :mod:`.attention`.

The kernels live in :mod:`.attention_forward` and :mod:`.attention_backward`; this module picks their
block sizes (fixed under the interpreter, autotuned on CUDA) and exposes them to the host side.

Legend and numerics as in :mod:`.attention`: ``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, Sk, D]``,
``G = Hq / Hkv``; scores and accumulators in fp32, exp2 with ``scale·log2 e`` folded into the scores.
``DOT_FP32`` casts every dot operand to fp32 (Triton's interpreter multiplies fp16/bf16 dot operands as
raw bits).

Causal masks are bottom-right aligned: query ``i`` sees keys ``j ≤ i + OFF`` with ``OFF = SK - SQ``, a
runtime int computed in the kernels (a constexpr would compile a new kernel at every decode step). A
block of queries ``[m, m + BLOCK_M)`` therefore sees every key below ``m + OFF + 1`` (no mask needed),
a band of keys up to ``min(m + BLOCK_M, SQ) + OFF`` through the mask, and nothing beyond; a block of
keys ``[n, n + BLOCK_N)`` is seen by no query below ``n - OFF`` and entirely by every query from
``n + BLOCK_N - 1 - OFF`` on. Rows with ``i + OFF < 0`` (only when ``SQ > SK``) see no key: their
running maximum stays ``-inf``, their sum 0, and they store ``out = 0``, ``lse = -inf``; the backward
masks them out (``exp2(s - lse)`` is ``+inf`` there, and only ever read through the mask).
"""

from __future__ import annotations

import triton

from ._dispatch import next_power_of_2
from .attention_backward import (
    _flash_attention_bwd_dkdv_kernel,
    _flash_attention_bwd_dq_kernel,
    _flash_attention_bwd_preprocess_kernel,
)
from .attention_forward import (
    _flash_attention_fwd_kernel,
    _flash_attention_split_kv_combine_kernel,
    _flash_attention_split_kv_kernel,
)

__all__ = [
    "INTERPRETER_DKDV_BLOCKS",
    "INTERPRETER_DQ_BLOCKS",
    "INTERPRETER_FWD_BLOCKS",
    "INTERPRETER_SPLIT_KV_BLOCK_N",
    "PREPROCESS_BLOCK_M",
    "SPLIT_KV_KEY_ALIGN",
    "_flash_attention_bwd_dkdv_kernel",
    "_flash_attention_bwd_dq_kernel",
    "_flash_attention_bwd_preprocess_kernel",
    "_flash_attention_fwd_kernel",
    "_flash_attention_split_kv_combine_kernel",
    "_flash_attention_split_kv_kernel",
    "dkdv_atomic_dq_kernel_tuned",
    "dkdv_kernel_tuned",
    "dq_kernel_tuned",
    "fwd_kernel_tuned",
    "sk_bucket",
    "split_kv_kernel_tuned",
    "tile_name",
    "tuned_programs",
]


# ----------------------------------------------------------------------------------------------------
# Block sizes
# ----------------------------------------------------------------------------------------------------


def _configs(shapes) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in shapes]


def sk_bucket(sk: int) -> int:
    """The autotuning key for the key length: its power-of-two bucket (at least 16).

    Decode calls the kernels with a key length one longer at every step; an exact key would re-run the
    autotuner (tens of timed launches) at every token. The query length stays exact, so with SQ == SK
    the key (SQ, bucket) is as fine as the former S and the square case tunes exactly as before.
    """
    return max(16, next_power_of_2(sk))


def _prune_for_short_sequences(configs, named_args, **kwargs):
    """Drop tiles longer than 64 over a shorter sequence (query tiles BLOCK_M over SQ, key tiles BLOCK_N over
    SK): mostly past the end, and costly to tune."""

    def fits(block: int, length: int) -> bool:
        return block <= max(64, next_power_of_2(length))

    sq, sk = named_args["SQ"], named_args["SK"]
    kept = [c for c in configs if fits(c.kwargs["BLOCK_M"], sq) and fits(c.kwargs["BLOCK_N"], sk)]
    return kept or configs


# Hopper (sm_90) candidates, chosen from what ptxas makes of them at bf16, D=128, causal and not
# (tests/kernels/sm90_compile.py reports registers, spills and local-memory traffic per loop step): every tile
# keeps its main loop free of register spills except the FlashAttention-2 backward tile (64×128, 8 warps), kept
# as a candidate for its wide MMAs although it refills a few dozen registers per step (16 to 43 with Triton 3.9;
# 79 per causal step with Triton 3.6, whose other tiles compile alike). Tiles of 128 query rows over 4 warps are
# left out: their fp32 accumulators (128×128 over 128 threads) spill at every step. The 64×64 and 64×32 tiles
# serve short sequences and fp32 with D=128, where the larger tiles overflow shared memory (the autotuner skips
# those).
_FWD_CONFIGS = _configs([
    (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3),
    (64, 32, 4, 2),
])  # fmt: skip
# dK/dV: each program owns a wide key tile (BLOCK_N) and streams narrow query tiles (BLOCK_M) past it. The
# two fp32 accumulators (dK, dV: 2·BLOCK_N·D) crowd the registers, so the tiles spread over 8 warps.
_DKDV_CONFIGS = _configs([
    (64, 128, 8, 3), (64, 64, 8, 3), (32, 128, 8, 3), (32, 128, 8, 2), (32, 64, 8, 3), (16, 128, 8, 3),
    (16, 64, 8, 3), (16, 32, 4, 2),
])  # fmt: skip
# The one-kernel backward holds the dS·K product of each step as well: 32-row tiles of 64 keys keep
# their loops spill-free, 32×128 refills a dozen registers per causal step.
_DKDV_ATOMIC_DQ_CONFIGS = _configs([
    (64, 128, 8, 3), (64, 64, 8, 3), (32, 128, 8, 3), (32, 64, 8, 3), (32, 64, 8, 2), (16, 128, 8, 3),
    (16, 64, 8, 3), (16, 32, 4, 2),
])  # fmt: skip
# dQ: each program owns a tall query tile (BLOCK_M) and streams narrow key tiles (BLOCK_N) past it.
_DQ_CONFIGS = _configs([
    (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2),
    (32, 16, 4, 2),
])  # fmt: skip

_TUNE = dict(
    key=["SQ", "SK_BUCKET", "HEAD_DIM", "CAUSAL", "SEGMENTS", "WINDOWED"],
    prune_configs_by={"early_config_prune": _prune_for_short_sequences},
)
fwd_kernel_tuned = triton.autotune(configs=_FWD_CONFIGS, **_TUNE)(_flash_attention_fwd_kernel)
dkdv_kernel_tuned = triton.autotune(configs=_DKDV_CONFIGS, **_TUNE)(_flash_attention_bwd_dkdv_kernel)
dq_kernel_tuned = triton.autotune(configs=_DQ_CONFIGS, **_TUNE)(_flash_attention_bwd_dq_kernel)
# The one-kernel backward (ATOMIC_DQ) adds onto its dQ accumulator: every timed launch of the autotuner
# starts from zeros again, and so does the launch that follows the tuning.
dkdv_atomic_dq_kernel_tuned = triton.autotune(configs=_DKDV_ATOMIC_DQ_CONFIGS, reset_to_zero=["dq_acc_ptr"], **_TUNE)(
    _flash_attention_bwd_dkdv_kernel
)

# Split-KV (decode): the host picks BLOCK_M from the rows (GROUP · SQ) and cuts the keys into splits of a
# multiple of SPLIT_KV_KEY_ALIGN, the widest key tile here, so every tile of a split is whole or the tail.
_SPLIT_KV_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
    for bn, w, st in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (64, 8, 2), (128, 4, 2))
]
SPLIT_KV_KEY_ALIGN = 128
split_kv_kernel_tuned = triton.autotune(
    configs=_SPLIT_KV_CONFIGS, key=["GROUP", "SQ", "SK_BUCKET", "HEAD_DIM", "CAUSAL", "FINAL", "BLOCK_M"]
)(_flash_attention_split_kv_kernel)

# Under the interpreter every block operation costs milliseconds of numpy work: blocks just large
# enough that the test sequences (1..130) span several query and key blocks, tails and diagonal bands.
INTERPRETER_FWD_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 16}
INTERPRETER_DKDV_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 32}
INTERPRETER_DQ_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 16}
INTERPRETER_SPLIT_KV_BLOCK_N = 16
PREPROCESS_BLOCK_M = 64


_TUNED = {
    "fwd": fwd_kernel_tuned,
    "dkdv": dkdv_kernel_tuned,
    "dq": dq_kernel_tuned,
    "dkdv+dq": dkdv_atomic_dq_kernel_tuned,
}


def tile_name(config: triton.Config) -> str:
    """``"64x128 w8 s3"``: an attention configuration's query rows × key columns, warps and pipeline stages."""
    return f"{config.kwargs['BLOCK_M']}x{config.kwargs['BLOCK_N']} w{config.num_warps} s{config.num_stages}"


def tuned_programs(*kernels: str) -> str | None:
    """``"fwd 64x64 w4 s3, dkdv 32x128 w8 s3"``: the tiles the autotuners of ``kernels`` (``"fwd"``,
    ``"dkdv"``, ``"dq"``, ``"dkdv+dq"`` for the one-kernel backward) picked at their latest launch; None
    before any tuned launch (the interpreter runs fixed blocks)."""
    unknown = [name for name in kernels if name not in _TUNED]
    if unknown:
        raise ValueError(f"kernels: expected names among {sorted(_TUNED)}, got {unknown}")
    picks = []
    for name in kernels:
        config = getattr(_TUNED[name], "best_config", None)
        if config is None:
            return None
        picks.append(f"{name} {tile_name(config)}")
    return ", ".join(picks)

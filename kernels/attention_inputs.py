"""Checks of flash attention's arguments, and the segment tables the kernels read for packed documents.

Shared by the kernels' host side (:mod:`.attention`), the plain-PyTorch reference
(:mod:`.attention_reference`) and ring attention (:mod:`tessel.parallel.context`): every refusal names
the argument, what was expected and what was received.

Segment tables (``SEGMENTS``): ``[B, 3, S]`` int32 per side, each token's segment id and the first and
one-past-last partner (a key for a query, a query for a key) of that segment. :func:`_segment_bounds`
builds one table for self attention (kept on the ids, so the layers of one forward build it once);
:func:`_cross_segment_bounds` builds the two tables of queries and keys that are different tokens of
one packed sequence (a ring step).
"""

from __future__ import annotations

import math

import torch

from ._memo import kept_on, kept_with

__all__ = ["HEAD_DIMS", "run_starts"]

HEAD_DIMS = (16, 32, 64, 128, 256)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_count(name: str, arg: str, value) -> None:
    """Raise unless ``value`` (argument ``arg``) is None or an int of at least 1."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: {arg} must be None or an int, received {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: {arg} must be None or at least 1, received {value}")


def _check_num_splits(num_splits) -> None:
    _check_count("flash_attention", "num_splits", num_splits)


def _check_window(name: str, window, causal: bool, arg: str = "window") -> None:
    """Raise unless ``window`` (argument ``arg``) is None, or an int of at least 1 with ``causal``."""
    _check_count(name, arg, window)
    if window is not None and not causal:
        raise ValueError(f"{name}: {arg}={window} needs causal=True (a query sees the window of keys up to its own)")


def _check_softcap(name: str, softcap) -> None:
    """Raise unless ``softcap`` is None or a finite number above 0."""
    if softcap is None:
        return
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{name}: softcap must be None or a number, received {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"{name}: softcap must be None or a finite number above 0, received {softcap}")


def _validate(name: str, q, k, v, causal, scale, dtypes, wide: bool = False) -> None:
    """Raise ValueError/TypeError naming what is wrong; shared by the kernel and the reference. ``wide``: head dims
    above the kernels' largest are taken too (computed in PyTorch, :func:`.attention_reference.wide_attention`)."""
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, received {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name}: {arg} must be 4-D [batch, heads, seq, head_dim], received shape {tuple(t.shape)}"
            )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"{name}: k and v must have the same sequence length (one value per key), received k "
            f"{tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"{name}: k and v must have the same shape, received k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    hq, d, hkv = q.shape[1], q.shape[3], k.shape[1]
    for what, dim in (("batch", 0), ("head-dim", 3)):  # q's sequence length may differ from k's
        if k.shape[dim] != q.shape[dim]:
            raise ValueError(
                f"{name}: {what} sizes differ: q is {tuple(q.shape)} and k, v are {tuple(k.shape)}; "
                f"expected k.shape[{dim}] == q.shape[{dim}] == {q.shape[dim]}"
            )
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{name}: q's head count {hq} must be a positive multiple of k's and v's head count {hkv}")
    if d not in HEAD_DIMS and not (wide and d > max(HEAD_DIMS)):
        above = f" or above {max(HEAD_DIMS)}" if wide else ""
        raise ValueError(f"{name}: head_dim must be one of {HEAD_DIMS}{above}, received {d}")
    if q.dtype not in dtypes:
        names = ", ".join(str(t).removeprefix("torch.") for t in dtypes)
        raise TypeError(f"{name}: q must be {names}, received {q.dtype}")
    for arg, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: {arg} must have q's dtype {q.dtype}, received {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: {arg} must be on q's device {q.device}, received {t.device}")
    if not isinstance(causal, bool):
        raise TypeError(f"{name}: causal must be a bool, received {type(causal).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"{name}: scale must be a number or None, received {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"{name}: scale must be finite, received {scale}")


def _segment_bounds(name: str, segment_ids, q, k) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The segment tables of ``segment_ids``, or None without them. Raises naming what is wrong.

    One ``[B, S]`` tensor (queries and keys of one sequence): one table serves both sides, with each
    token's run start as its id (kept on the ids, so the layers of one forward build it once). A pair
    ``(q_ids [B, Sq], kv_ids [B, Sk])``: the tables of :func:`_cross_segment_bounds` (kept on ``q_ids``
    while ``kv_ids`` is the same tensor, unchanged).
    """
    if segment_ids is None:
        return None
    if isinstance(segment_ids, tuple):
        if len(segment_ids) != 2:
            raise ValueError(f"{name}: segment_ids as a pair must be (q_segment_ids, kv_segment_ids), received "
                             f"{len(segment_ids)} items")  # fmt: skip
        q_ids = _check_ids(name, "segment_ids[0]", segment_ids[0], q, q.shape[2], "Sq")
        k_ids = _check_ids(name, "segment_ids[1]", segment_ids[1], q, k.shape[2], "Sk")
        _check_ordered(name, "segment_ids[0]", q_ids)
        _check_ordered(name, "segment_ids[1]", k_ids)
        return kept_with(q_ids, k_ids, "cross_segment_bounds", lambda: _cross_segment_bounds(q_ids, k_ids))
    sq, sk = q.shape[2], k.shape[2]
    if isinstance(segment_ids, torch.Tensor) and sq != sk:
        raise ValueError(f"{name}: one segment_ids tensor needs queries and keys of one sequence (Sq == Sk), "
                         f"received Sq={sq} and Sk={sk}; pass (q_segment_ids, kv_segment_ids) instead")  # fmt: skip
    segment_ids = _check_ids(name, "segment_ids", segment_ids, q, sq, "seq")
    return kept_on(segment_ids, "segment_bounds", lambda: _self_segment_bounds(segment_ids))


def _check_ids(name: str, arg: str, ids, q, length: int, dim: str) -> torch.Tensor:
    """Raise unless ``ids`` is an integer ``[B, length]`` tensor on q's device; return it."""
    if not isinstance(ids, torch.Tensor):
        also = " or a tuple (q_segment_ids, kv_segment_ids)" if arg == "segment_ids" else ""
        raise TypeError(f"{name}: {arg} must be None or a torch.Tensor{also}, received {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name}: {arg} must be an integer tensor, received {ids.dtype}")
    if tuple(ids.shape) != (q.shape[0], length):
        raise ValueError(f"{name}: {arg} must be [batch, {dim}] = {[q.shape[0], length]}, received {tuple(ids.shape)}")
    if ids.device != q.device:
        raise ValueError(f"{name}: {arg} must be on q's device {q.device}, received {ids.device}")
    return ids


def _check_ordered(name: str, arg: str, ids: torch.Tensor) -> None:
    """Raise unless ``ids`` are non-decreasing along each row, in ``[0, 2**31)`` (checked once per tensor: kept).

    Under torch.compile the check runs on the device (a graph cannot read the ids on the host): a fault stops
    the run with this message, without its place."""
    rule = (f"{name}: {arg} must be non-negative ids below 2**31, non-decreasing along each row (the segments "
            f"numbered in order)")  # fmt: skip

    def faults() -> torch.Tensor:
        wide = ids.long()  # 2**31 compared with int32 ids would wrap round
        bad = (wide < 0) | (wide >= 2**31)
        bad[:, 1:] |= wide[:, 1:] < wide[:, :-1]
        return bad

    if torch.compiler.is_compiling():
        torch._assert_async(faults().any().logical_not(), rule)
        return

    def first_fault() -> tuple[int, int, int] | None:
        bad = faults()
        if not bool(bad.any()):
            return None
        row, col = (int(i) for i in bad.nonzero()[0])
        return row, col, int(ids[row, col])

    fault = kept_on(ids, "ordered_segment_ids", first_fault)
    if fault is not None:
        row, col, value = fault
        raise ValueError(f"{rule}, received {value} at [{row}, {col}]")


def run_starts(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: True where a run of equal ``segment_ids`` (a packed document) begins."""
    first = torch.ones(segment_ids.shape, device=segment_ids.device, dtype=torch.bool)
    first[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return first


def _self_segment_bounds(segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, s = segment_ids.shape
    pos = torch.arange(s, device=segment_ids.device, dtype=torch.int32).expand(b, s)
    first = run_starts(segment_ids)
    last = torch.ones_like(first)
    last[:, :-1] = first[:, 1:]
    start = torch.where(first, pos, 0).cummax(1).values
    end = torch.where(last, pos + 1, s).flip(1).cummin(1).values.flip(1)
    table = torch.stack((start, start, end), 1).to(torch.int32).contiguous()
    return table, table


def _cross_segment_bounds(q_ids: torch.Tensor, k_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment tables of queries and keys with segment ids of their own (a block of ring attention, a
    padded batch, queries over a cache): query ``i`` sees key ``j`` exactly when ``q_ids[b, i] == k_ids[b, j]``.

    ``q_ids [B, Sq]``, ``k_ids [B, Sk]``: integer ids in ``[0, 2**31)``, non-decreasing along each row (for
    ring attention, the number of the segment each token lies in, counted over the whole sequence; not
    checked here). Returns ``[B, 3, Sq]`` and
    ``[B, 3, Sk]`` int32: each token's id, and the first and one past the last partner (key for a query,
    query for a key) with that id, an empty range where there is none.
    """
    q_ids, k_ids = q_ids.contiguous(), k_ids.contiguous()
    tables = []
    for ids, partners in ((q_ids, k_ids), (k_ids, q_ids)):
        lo = torch.searchsorted(partners, ids)
        hi = torch.searchsorted(partners, ids, right=True)
        tables.append(torch.stack((ids, lo, hi), 1).to(torch.int32).contiguous())
    return tables[0], tables[1]


def _segment_mask(segments, device) -> torch.Tensor | None:
    """``[B, 1, Sq, Sk]`` bool, True where a query and a key lie in different segments (None without)."""
    if segments is None:
        return None
    return (segments[0][:, 0, :, None] != segments[1][:, 0, None, :]).unsqueeze(1).to(device)

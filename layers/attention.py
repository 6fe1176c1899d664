"""Head-split tensor-parallel attention: fused QKV column-parallel, rotary, flash attention, row-parallel output.

Legend: ``B`` batch, ``S`` sequence, ``E`` model width, ``Hq``/``Hkv`` query/key-value heads, ``D`` head
dim, ``t`` tensor-parallel size. Rank r owns query heads ``[r·Hq/t, (r+1)·Hq/t)`` and kv heads
``[r·Hkv/t, (r+1)·Hkv/t)``: since ``Hq/Hkv`` is a whole number, the query heads of a GQA group and their
kv head land on the same rank, so attention needs no communication (Megatron-LM §3). ``qkv.weight`` is
``[(Hq + 2·Hkv)/t · D, E]`` (the q, k and v parts each split separately) and ``proj.weight`` is
``[E, Hq/t · D]``.

The local head counts are read from ``qkv``'s local part widths on every call, so replacing the two
projections with sharded ones (:func:`~tessel.layers.parallelize.parallelize`) is all it takes to
parallelise an attention module.

Fewer kv heads than TP ranks (``t`` a multiple of ``Hkv``, ``Hq`` of ``t``) are replicated as Megatron-LM replicates
them: rank r holds kv head ``r·Hkv/t``, the one its query heads read, in its ``qkv`` weight (``max_chunks = (None,
Hkv, Hkv)``: ``[Hq/t·D + 2·D, E]``); the ``t/Hkv`` copies of a head add up their gradients in backward
(:class:`~tessel.layers.linear.ColumnParallelLinear`'s ``max_chunks``), so they stay equal.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..kernels._memo import kept_on
from ..kernels.attention import flash_attention
from ..kernels.attention_inputs import _check_window
from ..parallel.comm import group_rank, group_size
from ..parallel.context import ring_attention, zigzag_positions
from .linear import ColumnParallelLinear, RowParallelLinear
from .rotary import apply_rotary, rotary_tables, segment_positions

__all__ = ["ParallelAttention", "check_heads", "check_window", "context_size"]


@functools.lru_cache(maxsize=32)
def _plain_rotary_tables(length: int, head_dim: int, theta: float, c: int, r: int, device, inference: bool):
    """Rotary tables of rank ``r`` of ``c``'s tokens (all of them for ``c = 1``), kept per shape and device: each
    layer of each forward needs the same ones. ``inference`` keys the tensors made under inference mode apart
    (they cannot be saved for a backward)."""
    positions = zigzag_positions(c * length, c, r, device=device) if c > 1 else None
    return rotary_tables(length, head_dim, theta, positions=positions, device=device)


def context_size(cp_group) -> int:
    """Ranks a layer's sequence is split over: 1 without a ``cp_group`` (``None`` here never means the world)."""
    return 1 if cp_group is None else group_size(cp_group)


def check_window(name: str, window, causal: bool, arg: str = "window") -> None:
    """Raise unless ``window`` is None, or an int of at least 1 with ``causal`` (as flash attention checks it):
    a TypeError for another type, a ValueError for another value."""
    _check_window(name, window, causal, arg)


def check_heads(name: str, n_head: int, n_kv_head: int, tp_size: int) -> None:
    """Raise a ValueError unless ``n_head`` query and ``n_kv_head`` kv heads split over ``tp_size`` ranks: the kv
    heads evenly, or, fewer than the ranks, each replicated on ``tp_size / n_kv_head`` of them (``n_kv_head``
    dividing ``tp_size``, ``tp_size`` dividing ``n_head``)."""
    if n_head <= 0 or n_kv_head <= 0:
        raise ValueError(f"{name}: head counts must be positive, received n_head={n_head}, n_kv_head={n_kv_head}")
    if n_head % n_kv_head:
        raise ValueError(f"{name}: n_head={n_head} is not a multiple of n_kv_head={n_kv_head}")
    if n_kv_head < tp_size and (tp_size % n_kv_head or n_head % tp_size):
        raise ValueError(
            f"{name}: n_kv_head={n_kv_head} is smaller than the tensor-parallel size {tp_size}; kv heads are "
            f"replicated over the ranks only when n_kv_head divides it and it divides n_head={n_head}"
        )
    if n_kv_head >= tp_size and n_kv_head % tp_size:
        raise ValueError(f"{name}: n_kv_head={n_kv_head} is not divisible by the tensor-parallel size {tp_size}")


class ParallelAttention(nn.Module):
    """Causal (by default) multi-head attention with GQA, rotary embeddings and heads split over TP ranks.

    Input and output are ``[B, S, E]`` (``[B, S/t, E]`` under ``sequence_parallel``: the QKV projection
    gathers the sequence inside its GEMM and the output projection reduce-scatters it, so attention
    itself always sees the whole sequence and rotary positions are global).

    ``deterministic=False`` runs flash attention's one-kernel backward (dQ added up with atomics; see
    :func:`~tessel.kernels.attention.flash_attention`); the default keeps gradients bit-reproducible.

    ``cp_group`` (context parallelism): the sequence is also split over this group's ``c`` ranks in
    :func:`~tessel.parallel.context.split_sequence`'s zigzag order, so the input is ``[B, S/c, E]``
    (``[B, S/(c·t), E]`` under sequence parallelism); attention runs as
    :func:`~tessel.parallel.context.ring_attention` and rotary embeddings use the global positions of
    the tokens this rank holds. ``None`` (default): no context parallelism, whatever the world size.

    ``window`` (with ``causal``): sliding-window attention, each token attending to the ``window`` latest
    tokens up to itself (flash attention's ``window``; Mistral's ``sliding_window``); under context
    parallelism the ring skips the blocks outside every window and moves only those inside
    (:func:`~tessel.parallel.context.ring_attention`'s ``window``).
    """

    def __init__(self, n_embd: int, n_head: int, n_kv_head: int | None = None, *, head_dim: int | None = None,
                 bias: bool = False, rope_theta: float | None = 10000.0, causal: bool = True, tp_group=None,
                 sequence_parallel: bool = False, overlap="auto", deterministic: bool = True, cp_group=None,
                 window: int | None = None, device=None, dtype=None):  # fmt: skip
        super().__init__()
        if not isinstance(deterministic, bool):
            raise TypeError(f"ParallelAttention: deterministic must be a bool, received {type(deterministic).__name__}")
        check_window("ParallelAttention", window, causal)
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        check_heads(type(self).__name__, n_head, n_kv_head, group_size(tp_group))
        if head_dim is None:
            if n_embd % n_head:
                raise ValueError(f"ParallelAttention: n_embd={n_embd} is not divisible by n_head={n_head}")
            head_dim = n_embd // n_head
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.rope_theta, self.causal, self.deterministic = rope_theta, causal, deterministic
        self.cp_group, self.window = cp_group, window
        kw = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, overlap=overlap, device=device, dtype=dtype)
        self.qkv = ColumnParallelLinear(n_embd, (n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim),
                                        bias, max_chunks=(None, n_kv_head, n_kv_head), **kw)  # fmt: skip
        self.proj = RowParallelLinear(n_head * head_dim, n_embd, bias, **kw)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, S, h·D]`` → ``[B, h, S, D]`` (a view: flash attention takes strided inputs)."""
        b, s, width = t.shape
        return t.view(b, s, width // self.head_dim, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, S, E]`` → ``[B, S, E]`` (the local shapes above).

        ``segment_ids``: ``None``, or an integer ``[B, S]`` tensor over the whole sequence (under sequence
        and context parallelism too: every rank passes the same ids) on x's device: documents packed into
        one row. Each run of equal ids attends only within itself and its rotary positions restart at 0
        (:func:`~tessel.layers.rotary.segment_positions`), so a document's outputs are those it would
        have alone.
        """
        if segment_ids is not None:
            self._check_segments(x, segment_ids)
        q, k, v = (self._heads(t) for t in self.qkv(x))
        c = self.cp_size
        if self.rope_theta is not None:
            cos, sin = self._rotary_tables(q.shape[2], segment_ids, q.device)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if c > 1:
            y = ring_attention(q, k, v, self.cp_group, causal=self.causal, deterministic=self.deterministic,
                               segment_ids=segment_ids, window=self.window)  # fmt: skip
        else:
            y = flash_attention(q, k, v, causal=self.causal, deterministic=self.deterministic, segment_ids=segment_ids,
                                window=self.window)  # fmt: skip
        b, h, s, d = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, s, h * d))

    def _rotary_tables(self, length: int, segment_ids: torch.Tensor | None, device) -> tuple[torch.Tensor, ...]:
        """cos, sin of the ``length`` tokens this rank holds; built once per forward, not once per layer: kept
        on ``segment_ids`` (which every layer shares), or without documents cached by shape."""
        c = self.cp_size
        r = group_rank(self.cp_group) if c > 1 else 0
        if segment_ids is None:
            if torch.compiler.is_compiling():  # computed in the graph, not kept across calls
                return _plain_rotary_tables.__wrapped__(length, self.head_dim, self.rope_theta, c, r, device, False)
            return _plain_rotary_tables(length, self.head_dim, self.rope_theta, c, r, device,
                                        torch.is_inference_mode_enabled())  # fmt: skip

        def make():
            positions = segment_positions(segment_ids)  # within each document
            if c > 1:  # the global positions of the tokens this rank holds
                positions = positions[:, zigzag_positions(c * length, c, r, device=device)]
            return rotary_tables(length, self.head_dim, self.rope_theta, positions=positions, device=device)

        return kept_on(segment_ids, ("rotary", length, self.head_dim, self.rope_theta, c, r), make)

    def _check_segments(self, x: torch.Tensor, segment_ids) -> None:
        name = type(self).__name__
        held = x.shape[1] * (self.qkv.tp_size if self.qkv.sequence_parallel else 1) if x.dim() == 3 else None
        length = None if held is None else held * self.cp_size
        ok = isinstance(segment_ids, torch.Tensor) and not segment_ids.is_floating_point()
        ok = ok and segment_ids.dtype != torch.bool and tuple(segment_ids.shape) == (x.shape[0], length)
        if not ok or segment_ids.device != x.device:
            got = (f"{segment_ids.dtype} tensor of shape {tuple(segment_ids.shape)} on {segment_ids.device}"
                   if isinstance(segment_ids, torch.Tensor) else type(segment_ids).__name__)  # fmt: skip
            raise ValueError(f"{name}: segment_ids must be an integer [B, S] = [{x.shape[0]}, {length}] tensor on "
                             f"{x.device} (S: the whole sequence), received {got}")  # fmt: skip

    def extra_repr(self) -> str:
        local = self.qkv.local_parts
        return (f"n_head={self.n_head} (local {local[0] // self.head_dim}), n_kv_head={self.n_kv_head} "
                f"(local {local[1] // self.head_dim}), head_dim={self.head_dim}, causal={self.causal}"
                + ("" if self.deterministic else ", deterministic=False")
                + ("" if self.window is None else f", window={self.window}")
                + (f", cp={self.cp_size}" if self.cp_size > 1 else ""))  # fmt: skip

    @property
    def cp_size(self) -> int:
        return context_size(self.cp_group)

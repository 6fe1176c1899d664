"""Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019, §3) with overlapped communication.

Legend: ``B`` batch, ``S`` sequence, ``K`` in_features, ``N`` out_features, ``t`` tensor-parallel size.
Parameters keep ``nn.Linear``'s layout and names: column ``weight [N/t, K]``, ``bias [N/t]``; row
``weight [N, K/t]``, ``bias [N]`` (whole, added once after the reduction).

Under sequence parallelism the activation entering a column layer and leaving a row layer is split along
the sequence (dim 1). The ops work on token-major 2-D matrices whose rows are ordered ``(s, b)``, so
that rank ``r``'s sequence block is one contiguous row block: the column layer returns a
``[B, S, N/t]`` view of an ``[S, B, N/t]`` buffer, and the row layer's ``transpose(0, 1)`` of it is
contiguous again, so a column → activation → row chain copies nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.collectives import copy_to_tp, gather_from_tp, split_to_tp
from ..parallel.comm import group_rank, group_size, subgroup
from ..parallel.overlap import (
    ALL_REDUCE_CHUNKS,
    all_gather_matmul,
    matmul_all_reduce,
    matmul_grad_all_reduce,
    matmul_reduce_scatter,
)
from ..parallel.sharding import local_shard, part_chunks
from .fp8 import Fp8Linear, column_parallel_fp8, row_parallel_fp8

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "column_outputs", "column_settings"]

# "auto" overlaps when each step's GEMM (one ring step: the tokens of one rank; one all-reduce chunk: a
# quarter of them) has at least this many multiply-adds. Measured with ``python -m tessel.bench overlap``
# on an H200 (bench/results/2026-11-23-h200-overlap.md): a ring step costs ~0.1 ms on top of its GEMM
# (launches and stream switches on the host), so steps below ~2^35 multiply-adds (~0.1 ms of bf16 GEMM
# there) made the chunked schedule 1.4-15x one GEMM, more than a transfer could hide; at or above it
# the schedule stayed within 1.2x. tests/layers/test_linear.py checks the rule against that record.
AUTO_OVERLAP_MIN_STEP_MACS = 2**35


def _check_fp8(name: str, fp8) -> bool:
    if not isinstance(fp8, bool):
        raise TypeError(f"{name}: fp8 must be a bool, received {type(fp8).__name__}")
    return fp8


def _check_overlap(name: str, overlap) -> None:
    if overlap not in ("auto", True, False, "peer"):
        raise ValueError(f"{name}: overlap must be 'auto', True, False or 'peer', received {overlap!r}")


def _use_overlap(overlap, t: int, tokens: int, k: int, n: int, steps: int | None = None) -> bool | str:
    """Whether to chunk: ``tokens × k × n`` multiply-adds cut into ``steps`` GEMMs (the ring's ``t`` by
    default; the all-reduce ops' ``ALL_REDUCE_CHUNKS``). ``"peer"`` stays ``"peer"`` (on more than one rank):
    every op takes the device-signalled transports, forward and backward (the all-reduce ops where the tokens
    split evenly over the ranks, their rings otherwise)."""
    if overlap == "peer":
        return "peer" if t > 1 else False
    if overlap == "auto":
        return t > 1 and tokens // (steps or t) * k * n >= AUTO_OVERLAP_MIN_STEP_MACS
    return bool(overlap)


def _check_divisible(name: str, arg: str, value: int, t: int) -> None:
    if value % t:
        raise ValueError(f"{name}: {arg}={value} is not divisible by the tensor-parallel size {t}")


def _check_input(layer: nn.Module, x, width: int, what: str) -> None:
    name = type(layer).__name__
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: input must be a torch.Tensor, received {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != width:
        raise ValueError(f"{name}: input's last dimension must be {what} = {width}, received shape {tuple(x.shape)}")
    if x.dtype != layer.weight.dtype:
        raise TypeError(f"{name}: input dtype must be the weight's {layer.weight.dtype}, received {x.dtype}")
    if x.device != layer.weight.device:
        raise ValueError(f"{name}: input must be on the weight's device {layer.weight.device}, received {x.device}")
    if layer.tp_group is not None or dist.is_initialized():
        check_group_device(name, layer.tp_group, x)


def check_group_device(owner: str, group, x: torch.Tensor, what: str = "one") -> None:
    """Raise unless ``x`` is on the device type ``group``'s backend moves (cuda for NCCL, cpu otherwise)."""
    backend = dist.get_backend(group)
    wanted = "cuda" if backend == "nccl" else "cpu"
    if x.device.type != wanted:
        raise ValueError(f"{owner}: the {backend} tensor-parallel group needs {wanted} tensors, received {what} on "
                         f"{x.device}")  # fmt: skip


def _check_sequence_parallel_input(layer: nn.Module, x: torch.Tensor) -> None:
    """``[B, S, F]``, or ``[T, F]``: the tokens of one row (a block that flattened its batch)."""
    if x.dim() not in (2, 3):
        raise ValueError(
            f"{type(layer).__name__}: sequence_parallel=True needs a [batch, seq, features] or [tokens, features] "
            f"input, received shape {tuple(x.shape)}"
        )


def _sequence_token_major(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 2 else _to_token_major(x)


def _sequence_from_token_major(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` (token-major rows) in the layout of the sequence-parallel input ``x``."""
    return y if x.dim() == 2 else _from_token_major(y, x.shape[0])


def _parts(out_features: int | Sequence[int]) -> tuple[int, ...]:
    return (out_features,) if isinstance(out_features, int) else tuple(out_features)


def _init_uniform(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    """nn.Linear's default initialisation, with the dense layer's fan-in (so shards match a dense init)."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        if bias is not None:
            bias.uniform_(-bound, bound)


def _mark_sharded(param: nn.Parameter | None, dim: int, parts: tuple[int, ...], max_chunks=None) -> None:
    """Tag a parameter split over the TP group (read by gradient clipping and by checkpoints).

    ``tp_parts`` are the global sizes along ``tp_dim`` of the parts fused in the parameter: the local
    tensor is the concatenation of each part's r-th of t chunks; ``tp_max_chunks`` caps a part's chunks, each
    then replicated on several ranks (:mod:`tessel.parallel.sharding`).
    """
    if param is not None:
        param.tensor_parallel, param.tp_dim, param.tp_parts = True, dim, tuple(parts)
        if max_chunks is not None:
            param.tp_max_chunks = tuple(max_chunks)


def _check_max_chunks(name: str, max_chunks, parts: tuple[int, ...], t: int) -> tuple[int, ...]:
    """The chunks each part is cut into over ``t`` ranks (``max_chunks``: None, or an int or None per part, each int
    dividing ``t`` where it is below it); raise a TypeError or ValueError naming ``max_chunks`` otherwise."""
    if max_chunks is None:
        return (t,) * len(parts)
    if isinstance(max_chunks, (str, bytes)) or not isinstance(max_chunks, Sequence):
        raise TypeError(f"{name}: max_chunks must be None or a sequence of ints or None, one per part of "
                        f"out_features, received {type(max_chunks).__name__}")  # fmt: skip
    ok = len(max_chunks) == len(parts)
    ok = ok and all(m is None or (isinstance(m, int) and not isinstance(m, bool) and m > 0) for m in max_chunks)
    if not ok:
        raise ValueError(f"{name}: max_chunks must hold a positive int or None for each of the {len(parts)} parts "
                         f"of out_features, received {tuple(max_chunks)!r}")  # fmt: skip
    for m in max_chunks:
        if m is not None and m < t and t % m:
            raise ValueError(f"{name}: max_chunks={tuple(max_chunks)}: a part cut into {m} chunks is replicated over "
                             f"the tensor-parallel size {t} only if {m} divides it")  # fmt: skip
    return part_chunks(parts, max_chunks, t)


def _replica_summed(p: torch.Tensor, local_parts, chunks: tuple[int, ...], groups: dict) -> torch.Tensor:
    """``p`` (a column layer's fused weight or bias) whose replicated chunks' gradients are summed over the ranks
    holding each, so that every copy gets the gradient of the whole group's use of it; the other rows as they are.

    The parts cut into ``c`` chunks go through ``copy_to_tp`` over ``groups[c]``, the ``t / c`` ranks holding this
    rank's chunk: one all-reduce of their rows over those ranks alone."""
    if not groups or not (p.requires_grad and torch.is_grad_enabled()):
        return p  # nothing to sum (inference, a frozen weight: not even a copy)
    pieces = list(p.split(local_parts, dim=0))
    for c, group in groups.items():
        which = [i for i, ci in enumerate(chunks) if ci == c]
        summed = copy_to_tp(torch.cat([pieces[i] for i in which]), group)
        for i, piece in zip(which, summed.split([local_parts[i] for i in which], dim=0)):
            pieces[i] = piece
    return torch.cat(pieces)


def _dense_source(cls, linear: nn.Module, parallel_cls) -> tuple[tuple[int, ...] | int, dict]:
    """The dense layout of ``linear`` (an nn.Linear or a parallel layer of a world of one) and its settings."""
    if isinstance(linear, parallel_cls):
        if linear.tp_size != 1:
            raise ValueError(
                f"{cls.__name__}.from_linear: the source layer is already split over {linear.tp_size} ranks; "
                "expected an nn.Linear or a layer of a world of one"
            )
        return linear.out_features, {"overlap": linear.overlap, "fp8": linear.fp8}
    if not isinstance(linear, nn.Linear):
        raise TypeError(
            f"{cls.__name__}.from_linear: expected an nn.Linear or a {parallel_cls.__name__} of a world of one, "
            f"received {type(linear).__name__}"
        )
    return linear.out_features, {"fp8": True} if isinstance(linear, Fp8Linear) else {}


def _column_block(full: torch.Tensor, layer: ColumnParallelLinear, parts: tuple[int, ...]) -> torch.Tensor:
    """``layer``'s rows of a fused dense tensor: the concatenation of each part's chunk on its rank."""
    return local_shard(full, 0, parts, layer.tp_rank, layer.tp_size, layer.chunks)


def _to_token_major(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, F]`` → ``[S·B, F]`` with rows ordered (s, b); free when x is a view of an [S, B, F] buffer."""
    return x.transpose(0, 1).reshape(-1, x.shape[-1])


def _from_token_major(y: torch.Tensor, batch: int) -> torch.Tensor:
    return y.view(-1, batch, y.shape[-1]).transpose(0, 1)


class ColumnParallelLinear(nn.Module):
    """``Y = X Wᵀ + b`` with W split by output rows: rank r holds rows ``[r·N/t, (r+1)·N/t)``.

    ``out_features`` may be a sequence (e.g. ``(q, k, v)`` sizes): the layer then holds one fused local
    weight (each part split separately, Megatron's fused QKV) and returns one output per part.

    Forward: with ``sequence_parallel`` the input is ``[B, S/t, K]`` and is all-gathered along the
    sequence inside the GEMM (:func:`~tessel.parallel.overlap.all_gather_matmul`); otherwise the input is
    replicated and only its gradient is all-reduced (:func:`~tessel.parallel.overlap.matmul_grad_all_reduce`).
    ``gather_output`` all-gathers the output features (for a layer not followed by a row-parallel one).
    ``regather_input`` (sequence parallelism only) keeps just the input shard for backward and gathers
    it again there: ``1/t`` of the saved activation for ``(t-1)/t`` of its size in extra traffic.
    ``fp8=True`` runs the GEMMs in fp8 (:mod:`tessel.layers.fp8`), the same rings gathering the input in fp8.

    ``max_chunks`` (one int or None per part) cuts a part into at most that many chunks: over more ranks ``t``
    (a multiple of it), each chunk is replicated on ``t / max_chunks`` consecutive ranks, as Megatron-LM replicates
    kv heads fewer than the ranks (``(None, Hkv, Hkv)`` of a ``(q, k, v)`` layer with ``D``-row heads keeps one kv
    head on each rank). In backward the copies' gradients are summed over the ranks holding them (one all-reduce
    of the local rows over those ranks alone), so every copy holds the gradient of the whole group's use of it.
    """

    def __init__(self, in_features, out_features, bias=True, *, tp_group=None, gather_output=False,
                 sequence_parallel=False, overlap="auto", regather_input=False, fp8=False, max_chunks=None,
                 device=None, dtype=None):  # fmt: skip
        super().__init__()
        name = type(self).__name__
        self.tp_group, self.tp_size, self.tp_rank = tp_group, group_size(tp_group), group_rank(tp_group)
        parts = _parts(out_features)
        self.chunks = _check_max_chunks(name, max_chunks, parts, self.tp_size)
        for n, c in zip(parts, self.chunks):
            if c < self.tp_size and n % c:
                raise ValueError(f"{name}: out_features={n} does not split into its max_chunks={c} chunks")
            _check_divisible(name, "out_features", n, c)
        _check_overlap(name, overlap)
        if gather_output and any(c < self.tp_size for c in self.chunks):
            raise ValueError(f"{name}: gather_output=True cannot gather parts replicated over ranks "
                             f"(max_chunks={tuple(max_chunks)} over {self.tp_size} ranks)")  # fmt: skip
        self.in_features, self.out_features = in_features, out_features
        self.max_chunks = None if max_chunks is None else tuple(max_chunks)
        # local rows of each part (``local_parts``: of each output, one for a packed layer)
        self.part_rows = self.local_parts = tuple(n // c for n, c in zip(parts, self.chunks))
        # for each chunk count below t, the ranks holding this rank's chunk (its copies' gradients summed over them)
        t, r = self.tp_size, self.tp_rank
        self.replica_groups = {c: subgroup(tp_group, r * c // t * (t // c), t // c) for c in sorted(set(self.chunks))
                               if c < t}  # fmt: skip
        self.gather_output, self.sequence_parallel, self.overlap = gather_output, sequence_parallel, overlap
        self.regather_input, self.fp8 = regather_input, _check_fp8(name, fp8)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(sum(self.local_parts), in_features, **kw))
        self.bias = nn.Parameter(torch.empty(sum(self.local_parts), **kw)) if bias else None
        _init_uniform(self.weight, self.bias, in_features)
        _mark_sharded(self.weight, dim=0, parts=parts, max_chunks=self.max_chunks)
        _mark_sharded(self.bias, dim=0, parts=parts, max_chunks=self.max_chunks)

    def replica_summed(self, p: torch.Tensor | None) -> torch.Tensor | None:
        return None if p is None else _replica_summed(p, self.part_rows, self.chunks, self.replica_groups)

    shared_input = None  # a SharedInput: the column layers called with the same tensor, computed in one op

    def forward(self, x: torch.Tensor):
        if self.shared_input is not None:
            return self.shared_input.output(self, x)
        return column_outputs([self], x)[0]

    @classmethod
    def from_linear(cls, linear: nn.Module, *, tp_group=None, **kwargs) -> ColumnParallelLinear:
        """Rank r of t takes the r-th of t contiguous row blocks of ``linear.weight`` (and of its bias).

        ``linear`` is an ``nn.Linear`` or a ``ColumnParallelLinear`` of a world of one, whose fused parts
        (Q, K, V; gate, up) are each split separately and whose ``gather_output``/``overlap`` are kept
        unless given.
        """
        out_features, inherited = _dense_source(cls, linear, ColumnParallelLinear)
        if isinstance(linear, ColumnParallelLinear):
            inherited.update(gather_output=linear.gather_output, regather_input=linear.regather_input,
                             max_chunks=linear.max_chunks)  # fmt: skip
        w = linear.weight
        layer = cls(linear.in_features, out_features, linear.bias is not None, tp_group=tp_group,
                    device=w.device, dtype=w.dtype, **{**inherited, **kwargs})  # fmt: skip
        parts = _parts(out_features)
        with torch.no_grad():
            layer.weight.copy_(_column_block(w, layer, parts))
            if layer.bias is not None:
                layer.bias.copy_(_column_block(linear.bias, layer, parts))
        return layer

    @classmethod
    def from_packed(cls, linear: nn.Linear, parts: Sequence[int], *, tp_group=None, **kwargs) -> ColumnParallelLinear:
        """One layer over the parts ``linear`` packs along its outputs, each split on its own: rank r keeps
        ``[gate_r; up_r]`` of a packed ``[gate; up]`` weight (so ``y.chunk(2, -1)`` still splits it), ``[q_r; k_r;
        v_r]`` of a fused ``[q; k; v]`` (which an attention slices by its local head counts); returns one tensor.
        ``max_chunks`` (in ``kwargs``) replicates parts fewer than the ranks (a multi-query ``[q; k; v]``: each rank's
        ``[q_r; k; v]``). Raises ``TypeError``/``ValueError`` for another module, or ``parts`` that do not add up to
        its outputs or do not each split over the group."""
        name = f"{cls.__name__}.from_packed"
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{name}: expected an nn.Linear, received {type(linear).__name__}")
        t = group_size(tp_group)
        parts = tuple(parts)
        if not all(isinstance(n, int) and n > 0 for n in parts) or sum(parts) != linear.out_features:
            raise ValueError(f"{name}: parts must be positive widths adding up to out_features={linear.out_features}, "
                             f"received {parts}")  # fmt: skip
        chunks = _check_max_chunks(name, kwargs.get("max_chunks"), parts, t)
        if any(n % c for n, c in zip(parts, chunks)):
            raise ValueError(f"{name}: parts {parts} do not each split over the tensor-parallel size {t}")
        w = linear.weight
        layer = cls(linear.in_features, parts, linear.bias is not None, tp_group=tp_group,
                    device=w.device, dtype=w.dtype, **kwargs)  # fmt: skip
        layer.out_features, layer.local_parts = linear.out_features, (sum(layer.part_rows),)
        with torch.no_grad():
            layer.weight.copy_(_column_block(w, layer, parts))
            if layer.bias is not None:
                layer.bias.copy_(_column_block(linear.bias, layer, parts))
        return layer

    @classmethod
    def from_linears(cls, linears: Sequence[nn.Linear], *, tp_group=None, **kwargs) -> ColumnParallelLinear:
        """One fused layer from several dense layers that share an input (Q, K, V; gate, up).

        Rank r's fused weight is the concatenation of the r-th row block of each layer's weight, so the
        input is gathered once and multiplied in one GEMM; the forward returns one output per layer.
        """
        linears = list(linears)
        if not linears or not all(isinstance(lin, nn.Linear) for lin in linears):
            raise TypeError("ColumnParallelLinear.from_linears: expected a non-empty sequence of nn.Linear")
        if len({(lin.in_features, lin.bias is not None, lin.weight.dtype) for lin in linears}) != 1:
            raise ValueError("ColumnParallelLinear.from_linears: the layers must share in_features, bias and dtype")
        first = linears[0]
        layer = cls(first.in_features, tuple(lin.out_features for lin in linears), first.bias is not None,
                    tp_group=tp_group, device=first.weight.device, dtype=first.weight.dtype, **kwargs)  # fmt: skip
        with torch.no_grad():
            layer.weight.copy_(_column_block(torch.cat([lin.weight for lin in linears]), layer, layer.out_features))
            if layer.bias is not None:
                layer.bias.copy_(_column_block(torch.cat([lin.bias for lin in linears]), layer, layer.out_features))
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local {self.local_parts}), "
                f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}, overlap={self.overlap}"
                + ("" if self.max_chunks is None else f", max_chunks={self.max_chunks}")
                + (", fp8=True" if self.fp8 else ""))  # fmt: skip


def column_settings(c: ColumnParallelLinear) -> tuple:
    """What column layers computed in one op (:func:`column_outputs`) must share."""
    return (c.tp_group, c.in_features, c.sequence_parallel, c.overlap, c.regather_input, c.weight.dtype,
            c.weight.device)  # fmt: skip


def column_outputs(columns: Sequence[ColumnParallelLinear], x: torch.Tensor) -> list:
    """Each of ``columns``' outputs for the input ``x`` (their forwards), computed in one op: one all-reduce of the
    input's gradient for all (or one all-gather ring of the sequence-parallel input), the wgrad GEMMs overlapping it.
    The layers share their tensor-parallel group, input width and settings, and run in fp8 all or none (their
    weights quantised as one, as a fused layer's). Raises ``TypeError``/``ValueError`` otherwise."""
    columns = list(columns) if isinstance(columns, Sequence) else columns
    if not isinstance(columns, list) or not columns or not all(isinstance(c, ColumnParallelLinear) for c in columns):
        raise TypeError(f"column_outputs: columns must be a non-empty sequence of ColumnParallelLinear, received "
                        f"{columns!r:.200}")  # fmt: skip
    if len({(*column_settings(c), c.fp8) for c in columns}) > 1:
        raise ValueError("column_outputs: the layers must share their tensor-parallel group, in_features, "
                         "sequence_parallel, overlap, regather_input, dtype and device, and run in fp8 all or "
                         "none")  # fmt: skip
    first = columns[0]
    _check_input(first, x, first.in_features, "in_features")
    weights = [c.replica_summed(c.weight) for c in columns]
    biases = [c.replica_summed(c.bias) for c in columns]
    weight, bias = (weights[0], biases[0]) if len(columns) == 1 else (weights, biases)
    n_local, t, group = sum(w.shape[0] for w in weights), first.tp_size, first.tp_group
    if first.sequence_parallel:
        _check_sequence_parallel_input(first, x)
        x2 = _sequence_token_major(x)
        ov = _use_overlap(first.overlap, t, x2.shape[0] * t, first.in_features, n_local)
        if first.fp8:
            y = column_parallel_fp8(x2, weight, bias, group, sequence_parallel=True, overlap=ov,
                                    regather=first.regather_input)  # fmt: skip
        else:
            y = all_gather_matmul(x2, weight, group, biases=bias, overlap=ov, regather=first.regather_input)
        ys = [_sequence_from_token_major(y, x) for y in (y if len(columns) > 1 else [y])]
    else:
        x2 = x.reshape(-1, first.in_features)
        ov = _use_overlap(first.overlap, t, x2.shape[0], first.in_features, n_local, ALL_REDUCE_CHUNKS)
        if first.fp8:
            y = column_parallel_fp8(x2, weight, bias, group, sequence_parallel=False, overlap=ov)
        else:
            y = matmul_grad_all_reduce(x2, weight, group, biases=bias, overlap=ov)
        ys = [y.view(*x.shape[:-1], y.shape[-1]) for y in (y if len(columns) > 1 else [y])]
    outputs = []
    for c, y in zip(columns, ys):
        outs = y.split(c.local_parts, dim=-1) if len(c.local_parts) > 1 else (y,)
        if c.gather_output:
            outs = tuple(gather_from_tp(o, group, dim=-1) for o in outs)
        outputs.append(outs if len(c.local_parts) > 1 else outs[0])
    return outputs


class RowParallelLinear(nn.Module):
    """``Y = X Wᵀ + b`` with W split by input columns: rank r holds columns ``[r·K/t, (r+1)·K/t)``.

    Forward: each rank multiplies its slice of the input features; the partial outputs are summed by a
    reduce-scatter along the sequence inside the GEMM when ``sequence_parallel`` (output ``[B, S/t, N]``,
    :func:`~tessel.parallel.overlap.matmul_reduce_scatter`), by a chunked all-reduce otherwise
    (:func:`~tessel.parallel.overlap.matmul_all_reduce`). The bias is whole and added once; its gradient
    is summed over every token of every rank. ``input_is_parallel=False`` splits a full input first.
    ``fp8=True`` runs the GEMMs in fp8 (:mod:`tessel.layers.fp8`), the backward ring gathering dY in fp8.
    """

    def __init__(self, in_features, out_features, bias=True, *, tp_group=None, input_is_parallel=True,
                 sequence_parallel=False, overlap="auto", fp8=False, device=None, dtype=None):  # fmt: skip
        super().__init__()
        name = type(self).__name__
        self.tp_group, self.tp_size, self.tp_rank = tp_group, group_size(tp_group), group_rank(tp_group)
        _check_divisible(name, "in_features", in_features, self.tp_size)
        _check_overlap(name, overlap)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.overlap = input_is_parallel, sequence_parallel, overlap
        self.fp8 = _check_fp8(name, fp8)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp_size, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        _init_uniform(self.weight, self.bias, in_features)
        _mark_sharded(self.weight, dim=1, parts=(in_features,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            _check_input(self, x, self.in_features, "in_features")
            x = split_to_tp(x, self.tp_group, dim=-1)
        k_local = self.weight.shape[1]
        _check_input(self, x, k_local, "in_features / tp")
        if self.sequence_parallel:
            _check_sequence_parallel_input(self, x)
            if x.shape[-2] % self.tp_size:
                raise ValueError(f"RowParallelLinear: sequence length {x.shape[-2]} is not divisible by the "
                                 f"tensor-parallel size {self.tp_size} (sequence_parallel=True)")  # fmt: skip
            x2 = _sequence_token_major(x)
            ov = _use_overlap(self.overlap, self.tp_size, x2.shape[0], k_local, self.out_features)
            if self.fp8:
                y = row_parallel_fp8(x2, self.weight, self.bias, self.tp_group, sequence_parallel=True, overlap=ov)
            else:
                y = matmul_reduce_scatter(x2, self.weight, self.tp_group, bias=self.bias, overlap=ov)
            return _sequence_from_token_major(y, x)
        x2 = x.reshape(-1, k_local)
        ov = _use_overlap(self.overlap, self.tp_size, x2.shape[0], k_local, self.out_features, ALL_REDUCE_CHUNKS)
        if self.fp8:
            y = row_parallel_fp8(x2, self.weight, self.bias, self.tp_group, sequence_parallel=False, overlap=ov)
        else:
            y = matmul_all_reduce(x2, self.weight, self.tp_group, bias=self.bias, overlap=ov)
        return y.view(*x.shape[:-1], self.out_features)

    @classmethod
    def from_linear(cls, linear: nn.Module, *, tp_group=None, **kwargs) -> RowParallelLinear:
        """Rank r of t takes the r-th of t contiguous column blocks of ``linear.weight``; the bias stays whole.

        ``linear`` is an ``nn.Linear`` or a ``RowParallelLinear`` of a world of one (whose
        ``input_is_parallel``/``overlap`` are kept unless given).
        """
        _, inherited = _dense_source(cls, linear, RowParallelLinear)
        if isinstance(linear, RowParallelLinear):
            inherited["input_is_parallel"] = linear.input_is_parallel
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, tp_group=tp_group,
                    device=w.device, dtype=w.dtype, **{**inherited, **kwargs})  # fmt: skip
        cols = slice(layer.tp_rank * layer.weight.shape[1], (layer.tp_rank + 1) * layer.weight.shape[1])
        with torch.no_grad():
            layer.weight.copy_(w[:, cols])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
                f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}, overlap={self.overlap}"
                + (", fp8=True" if self.fp8 else ""))  # fmt: skip

"""``PipelineStage``: one piece of a model on one pipeline rank, and what crosses its boundaries.

Stage ``s`` of ``S`` lives on rank ``s % p`` of the pipeline group (``p`` its size); with ``S = v·p`` a
rank holds ``v`` stages (interleaving) and passes them to ``ScheduleInterleaved1F1B`` as a list. A stage's
module takes the previous stage's outputs as positional arguments (the first stage: the microbatch of
the schedule's inputs) and returns a tensor or a tuple of tensors (the last stage: what the loss
function takes).

The shapes and dtypes crossing a boundary are inferred from the first microbatch: before the first
activation, the sending rank sends a small int64 metadata tensor (:func:`encode_meta`) from which the
receiving rank allocates its buffers; gradients flowing back have the shapes of the activations, so
they need none. Later microbatches and steps must keep those shapes, which the sending stage checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm import group_rank, group_size

__all__ = ["META_NUMEL", "PipelineStage", "TensorMeta", "decode_meta", "encode_meta"]

TensorMeta = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype) of one tensor crossing a boundary

META_NUMEL = 64  # int64 slots: [count, then per tensor: dtype code, ndim, *shape], padded with -1
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64,
)  # fmt: skip


def encode_meta(metas: Sequence[TensorMeta]) -> torch.Tensor:
    """The metadata tensor describing ``metas``; raises ``ValueError`` if they do not fit or a dtype is unknown."""
    flat = [len(metas)]
    for shape, dtype in metas:
        if dtype not in _DTYPES:
            raise ValueError(f"PipelineStage: cannot send a {dtype} tensor between stages; supported: {_DTYPES}")
        flat += [_DTYPES.index(dtype), len(shape), *shape]
    if len(flat) > META_NUMEL:
        raise ValueError(
            f"PipelineStage: the tensors crossing a stage boundary need {len(flat)} metadata slots, more than "
            f"{META_NUMEL}: send fewer tensors or fewer dimensions"
        )
    return torch.tensor(flat + [-1] * (META_NUMEL - len(flat)), dtype=torch.int64)


def decode_meta(meta: torch.Tensor) -> list[TensorMeta]:
    flat = meta.tolist()
    metas, pos = [], 1
    for _ in range(flat[0]):
        code, ndim = flat[pos], flat[pos + 1]
        metas.append((tuple(flat[pos + 2 : pos + 2 + ndim]), _DTYPES[code]))
        pos += 2 + ndim
    return metas


def meta_of(tensors: Sequence[torch.Tensor]) -> list[TensorMeta]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"PipelineStage: {name} must be an int, received {type(value).__name__} {value!r}")


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``: ``module`` on pipeline rank ``stage_index % group size``.

    ``group`` is the pipeline group (``ParallelDims.pp_group``); ``None`` means the default group, or a
    world of one when no process group exists. The stage's device is its module's (CPU without
    parameters); a NCCL group needs CUDA modules.
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, group: dist.ProcessGroup | None = None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"PipelineStage: module must be an nn.Module, received {type(module).__name__}")
        _check_int("stage_index", stage_index)
        _check_int("num_stages", num_stages)
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(
                f"PipelineStage: stage_index must be in [0, num_stages), received stage_index={stage_index}, "
                f"num_stages={num_stages}"
            )
        self.module, self.stage_index, self.num_stages, self.group = module, stage_index, num_stages, group
        self.group_size, self.group_rank = group_size(group), group_rank(group)
        if num_stages % self.group_size:
            raise ValueError(
                f"PipelineStage: num_stages={num_stages} is not a multiple of the pipeline group size "
                f"{self.group_size} (every rank holds the same number of stages)"
            )
        if stage_index % self.group_size != self.group_rank:
            raise ValueError(
                f"PipelineStage: stage {stage_index} lives on pipeline rank {stage_index % self.group_size} "
                f"(stage_index % {self.group_size}), but this process is pipeline rank {self.group_rank}"
            )
        param = next(iter(module.parameters()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.input_meta: list[TensorMeta] | None = None  # what arrives from stage_index - 1
        self.output_meta: list[TensorMeta] | None = None  # what leaves for stage_index + 1

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return (
            f"PipelineStage(stage {self.stage_index} of {self.num_stages} on pipeline rank {self.group_rank} "
            f"of {self.group_size}, {type(self.module).__name__})"
        )

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run the module; returns its output as a tuple of tensors (a single tensor becomes a 1-tuple)."""
        out = self.module(*args)
        outs = out if isinstance(out, tuple | list) else (out,)
        for t in outs:
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"PipelineStage: stage {self.stage_index}'s module must return a tensor or a tuple of tensors, "
                    f"received {type(out).__name__} holding {type(t).__name__}"
                )
        return tuple(outs)

    def check_output_meta(self, outputs: Sequence[torch.Tensor]) -> bool:
        """Record the outputs' metadata the first time (returns True: it must be sent); then check it."""
        metas = meta_of(outputs)
        if self.output_meta is None:
            self.output_meta = metas
            return True
        if metas != self.output_meta:
            raise ValueError(
                f"PipelineStage: stage {self.stage_index} now outputs {_describe(metas)}, but the first microbatch "
                f"output {_describe(self.output_meta)}; the shapes crossing stages are fixed at the first "
                "microbatch (build new stages for another microbatch size)"
            )
        return False


def _describe(metas: Sequence[TensorMeta]) -> str:
    return ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}" for s, d in metas)

"""Vocabulary-parallel embedding (Megatron-LM, Shoeybi et al. 2019, §3): the table's rows split over TP ranks.

Legend: ``B`` batch, ``S`` sequence, ``H`` embedding_dim, ``V`` num_embeddings, ``t`` tensor-parallel size.
Rank ``r`` owns rows ``[r·V/t, (r+1)·V/t)`` of the table as ``.weight [V/t, H]``.

Forward: each rank looks up the ids it owns, zeroes the rows of the ids it does not, and the ranks' partial
outputs are summed: an all-reduce (``reduce_from_tp``, output ``[B, S, H]`` replicated) or, with
``sequence_parallel``, a reduce-scatter along the sequence (output ``[B, S/t, H]``). Backward: the output
gradient reaches every rank (identity, or an all-gather of the sequence shards) and each rank's table
gradient is non-zero only in the rows of ids it owns.

Under sequence parallelism the lookup runs token-major (``[S, B, H]``), so that the reduce-scatter's
blocks are contiguous and the ``[B, S/t, H]`` result is a view of an ``[S/t, B, H]`` buffer: the layout
the parallel linear layers and norms read without a copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.collectives import reduce_from_tp, reduce_scatter_to_sequence
from ..parallel.comm import group_rank, group_size

__all__ = ["VocabParallelEmbedding"]

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_ids(owner: str, name: str, ids, high: int, ignore: int | None = None) -> None:
    """Raise unless ``ids`` is an integer tensor with values in ``[0, high)`` (``ignore`` also allowed).

    The value check reads the tensor on the host, so it runs only for CPU tensors; on CUDA it is
    queued as a device-side assertion (``torch._assert_async``) that costs no host synchronisation.
    """
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, received {type(ids).__name__}")
    if ids.dtype not in _INT_DTYPES:
        raise TypeError(f"{owner}: {name} must be an integer tensor (e.g. torch.long), received {ids.dtype}")
    if ids.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = (ids < 0) | (ids >= high)
        if ignore is not None:
            bad &= ids != ignore
        if bad.any():
            raise ValueError(f"{owner}: {name} must lie in [0, {high}), received {ids[bad][0].item()}")
    elif ids.device.type in ("cuda", "cpu") and ids.numel():  # checked on the device (and in compiled graphs)
        ok = (ids >= 0) & (ids < high)
        if ignore is not None:
            ok |= ids == ignore
        torch._assert_async(ok.all(), f"{owner}: {name} must lie in [0, {high})")


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the table's rows split over the tensor-parallel group.

    ``padding_idx`` (a global id) behaves as in ``nn.Embedding``: its row starts at zero and receives no
    gradient. ``.weight`` carries ``tensor_parallel = True``, ``tp_dim = 0`` and ``tp_parts = (V,)``,
    which tells gradient-norm clipping and checkpointing that it is a shard of a ``[V, H]`` table.
    """

    def __init__(self, num_embeddings, embedding_dim, *, tp_group=None, sequence_parallel=False, padding_idx=None,
                 device=None, dtype=None):  # fmt: skip
        super().__init__()
        name = type(self).__name__
        self.tp_group, self.tp_size, self.tp_rank = tp_group, group_size(tp_group), group_rank(tp_group)
        for arg, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, received {value!r}")
        if num_embeddings % self.tp_size:
            raise ValueError(f"{name}: num_embeddings={num_embeddings} is not divisible by the tensor-parallel "
                             f"size {self.tp_size}")  # fmt: skip
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(f"{name}: padding_idx must lie in [0, {num_embeddings}), received {padding_idx}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel, self.padding_idx = sequence_parallel, padding_idx
        rows = num_embeddings // self.tp_size
        self.vocab_start, self.vocab_end = self.tp_rank * rows, (self.tp_rank + 1) * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, device=device, dtype=dtype))
        self.weight.tensor_parallel, self.weight.tp_dim, self.weight.tp_parts = True, 0, (num_embeddings,)
        self.reset_parameters()

    @property
    def _local_padding_idx(self) -> int | None:
        if self.padding_idx is None or not self.vocab_start <= self.padding_idx < self.vocab_end:
            return None
        return self.padding_idx - self.vocab_start

    def reset_parameters(self) -> None:
        """normal(0, 1) like ``nn.Embedding`` (each rank draws its own rows), the padding row zero."""
        with torch.no_grad():
            self.weight.normal_()
            if self._local_padding_idx is not None:
                self.weight[self._local_padding_idx].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        check_ids(name, "ids", ids, self.num_embeddings)
        if ids.device != self.weight.device:
            raise ValueError(f"{name}: ids must be on the weight's device {self.weight.device}, received {ids.device}")
        if self.sequence_parallel:
            if ids.dim() != 2:
                raise ValueError(f"{name}: sequence_parallel=True needs [batch, seq] ids, received {tuple(ids.shape)}")
            if ids.shape[1] % self.tp_size:
                raise ValueError(f"{name}: sequence length {ids.shape[1]} is not divisible by the tensor-parallel "
                                 f"size {self.tp_size} (sequence_parallel=True)")  # fmt: skip
            out_SBH = self._partial_lookup(ids.t())
            if self.tp_size == 1:
                return out_SBH.transpose(0, 1)
            return reduce_scatter_to_sequence(out_SBH, self.tp_group, dim=0).transpose(0, 1)
        out = self._partial_lookup(ids)
        return out if self.tp_size == 1 else reduce_from_tp(out, self.tp_group)

    def _partial_lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the ids this rank owns; zeros (with zero gradient) for the others."""
        ids = ids.long()
        if self.tp_size == 1:
            return F.embedding(ids, self.weight, self._local_padding_idx)
        foreign = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = torch.where(foreign, 0, ids - self.vocab_start)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)
        return out.masked_fill(foreign.unsqueeze(-1), 0.0)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, tp_group=None, **kwargs) -> VocabParallelEmbedding:
        """Rank r of t takes rows ``[r·V/t, (r+1)·V/t)`` of ``embedding.weight``; keeps its padding_idx."""
        name = f"{cls.__name__}.from_embedding"
        if isinstance(embedding, VocabParallelEmbedding) and embedding.tp_size == 1:
            padding_idx = embedding.padding_idx
        elif isinstance(embedding, nn.Embedding):
            unsupported = {"max_norm": embedding.max_norm is not None, "sparse": embedding.sparse,
                           "scale_grad_by_freq": embedding.scale_grad_by_freq}  # fmt: skip
            if any(unsupported.values()):
                raise ValueError(f"{name}: {', '.join(k for k, v in unsupported.items() if v)} is not supported")
            padding_idx = embedding.padding_idx
        else:
            raise TypeError(f"{name}: expected an nn.Embedding (or a {cls.__name__} of a world of one), received "
                            f"{type(embedding).__name__}")  # fmt: skip
        w = embedding.weight
        layer = cls(w.shape[0], w.shape[1], tp_group=tp_group, padding_idx=padding_idx, device=w.device,
                    dtype=w.dtype, **kwargs)  # fmt: skip
        with torch.no_grad():
            layer.weight.copy_(w[layer.vocab_start : layer.vocab_end])
        return layer

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local rows [{self.vocab_start}, {self.vocab_end})), {self.embedding_dim}, "
                f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""))  # fmt: skip

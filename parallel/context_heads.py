"""Between a context-parallel split of the sequence and a split of the features (heads): the all-to-all pair that
lets a token mixer other than attention (a state-space scan, linear attention, a causal convolution) run over the
whole sequence under context parallelism.

Each of ``c`` ranks holds its zigzag share of the tokens (:func:`~tessel.parallel.context.split_sequence`: chunks
``r`` and ``2c-1-r`` of ``2c``) with all of a block's features. :func:`sequence_to_heads` sends every rank the
features it owns (its heads) of this rank's tokens and puts what it receives back in sequence order: each rank then
holds the whole sequence of ``1/c`` of the features, over which a recurrence runs as it would on one device.
:func:`heads_to_sequence` is the way back. Megatron-LM runs Mamba under context parallelism the same way; the
traffic of each is ``(c-1)/c`` of the tensor a rank sends, against a ring's passing of states for every chunk.

Both are differentiable: the backward of one is the other's exchange, the gradient rows travelling back to the
rank they came from (:func:`~tessel.parallel.collectives.exchange_rows`).
"""

from __future__ import annotations

import functools

import torch

from .collectives import exchange_rows
from .comm import group_size
from .context import zigzag_order

__all__ = ["heads_to_sequence", "sequence_to_heads", "split_features"]


def _check_share(op: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, received {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be [batch, sequence, features], received shape {tuple(x.shape)}")


@functools.lru_cache(maxsize=64)
def _orders(length: int, c: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The zigzag order of a sequence of ``length`` over ``c`` ranks and its inverse, on ``device``: made once (each
    call of a mixer's exchange would otherwise build and sort it again)."""
    order = zigzag_order(length, c, device=device)
    return order, torch.argsort(order)


def split_features(width: int, c: int, group_width: int = 0) -> torch.Tensor:
    """``[c, width/c]`` (int64): the features of ``width`` each of ``c`` ranks owns, a contiguous ``1/c`` each.

    ``group_width`` (> 0): the features are groups of that width (a Mamba-2 block's B or C, one group per head
    group); where the groups do not split over the ranks (``c`` a multiple of their number) rank ``k`` owns the
    whole group ``k·G/c`` instead, which other ranks own too."""
    for name, value in (("width", width), ("c", c), ("group_width", group_width)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"split_features: {name} must be an int, received {type(value).__name__}")
    if width < 1 or c < 1 or group_width < 0:
        raise ValueError(f"split_features: need width ≥ 1, c ≥ 1 and group_width ≥ 0, received width={width}, c={c}, "
                         f"group_width={group_width}")  # fmt: skip
    ranks = torch.arange(c)
    if group_width:
        groups = width // group_width
        if width % group_width or not (groups % c == 0 or c % groups == 0):
            raise ValueError(f"split_features: {width} features in groups of {group_width} must make a number of "
                             f"groups that divides or is divided by c={c}")  # fmt: skip
        if groups % c:
            starts = ranks * groups // c * group_width
            return starts[:, None] + torch.arange(group_width)
    if width % c:
        raise ValueError(f"split_features: {width} features do not split over c={c} ranks")
    n = width // c
    return ranks[:, None] * n + torch.arange(n)


def sequence_to_heads(x: torch.Tensor, group, index: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, L, F]``, this rank's zigzag share of the tokens with every feature → ``[B, c·L, F']``, the whole
    sequence, in order, of the features this rank owns.

    ``index`` ``[c, F']`` (int64): the features of ``x`` each rank owns (several ranks may own one: its gradient is
    then the sum of theirs); by default a contiguous ``1/c`` each (:func:`split_features`). Its values are checked
    when it is on the CPU; an index on ``x``'s accelerator is taken as given (checking would wait for the device), as
    a caller that calls this every step places it there once. Forward: one all-to-all of ``(c-1)/c·B·L·c·F'``
    elements; backward: the same reversed. In a world of one, ``x`` indexed."""
    _check_share("sequence_to_heads", x)
    c = group_size(group)
    if index is None:
        index = split_features(x.shape[-1], c)
    if not isinstance(index, torch.Tensor) or index.dim() != 2 or index.shape[0] != c or index.dtype != torch.int64:
        raise ValueError(f"sequence_to_heads: index must be an int64 tensor [c={c}, features], received "
                         f"{getattr(index, 'dtype', type(index).__name__)} of shape "
                         f"{tuple(getattr(index, 'shape', ()))}")  # fmt: skip
    if index.device.type == "cpu" and index.numel() and not (int(index.min()) >= 0 and int(index.max()) < x.shape[-1]):
        raise ValueError(f"sequence_to_heads: index must pick features of x's {x.shape[-1]}, received values in "
                         f"[{int(index.min())}, {int(index.max())}]")  # fmt: skip
    b, length, n = x.shape[0], x.shape[1], index.shape[1]
    send = x.index_select(-1, index.to(x.device).flatten())  # [B, L, c·F']: the features of rank 0, of rank 1…
    if c == 1:
        return send
    if length % 2:
        raise ValueError(f"sequence_to_heads: each rank holds two equal chunks of the sequence, so x.shape[1] must be "
                         f"even, received {length}")  # fmt: skip
    send = send.unflatten(-1, (c, n)).permute(2, 0, 1, 3).contiguous()  # [c, B, L, F']
    received = exchange_rows(send.flatten(0, 1), group, [b] * c, [b] * c)  # rank j's tokens of this rank's features
    by_rank = received.unflatten(0, (c, b)).transpose(0, 1).flatten(1, 2)  # [B, c·L, F'] in zigzag_order
    return by_rank.index_select(1, _orders(c * length, c, x.device)[1])


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, S, F']``, the whole sequence of the features this rank owns → ``[B, S/c, c·F']``, this rank's zigzag
    share of the tokens with the features of every rank, rank after rank: the inverse of :func:`sequence_to_heads`
    with contiguous shares. Forward: one all-to-all; backward: the same reversed. In a world of one, ``x``."""
    _check_share("heads_to_sequence", x)
    c = group_size(group)
    if c == 1:
        return x
    b, length = x.shape[:2]
    if length % (2 * c):
        raise ValueError(f"heads_to_sequence: the sequence of {length} tokens must be divisible by 2·c = {2 * c}")
    by_rank = x.index_select(1, _orders(length, c, x.device)[0])  # rank 0's tokens, rank 1's…
    send = by_rank.unflatten(1, (c, length // c)).transpose(0, 1).contiguous()  # [c, B, L, F']
    received = exchange_rows(send.flatten(0, 1), group, [b] * c, [b] * c)  # rank k's features of this rank's tokens
    return received.unflatten(0, (c, b)).permute(1, 2, 0, 3).flatten(2)  # [B, L, c·F']

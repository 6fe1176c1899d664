"""tessel's attention implementation for Hugging Face models: ``attn_implementation="tessel"``.

:func:`tessel_attention_forward` runs :func:`~tessel.kernels.attention.flash_attention` wherever the
kernel computes exactly what Hugging Face asked for, and Hugging Face's own ``sdpa`` implementation
everywhere else, so switching a model to ``"tessel"`` never changes its results beyond rounding.

The kernel takes:

- a plain causal (or full) mask, which Hugging Face passes as ``None``;
- one query over a key-value cache (a decoding step sees every cached key, ``None`` as well; past a
  sliding window the mask holds the cache's last ``W`` keys, checked once per forward, and the kernel
  reads them as a slice of the cache);
- every other boolean mask that is causal (or full) attention between tokens of equal segment ids, which
  :func:`mask_segments` finds and checks entry by entry, once per forward (the result is kept on the mask
  tensor, which every layer shares), in row chunks that hold ``2**24`` entries at a time:

  - packed sequences: documents concatenated into one row, their ``position_ids`` restarting at each
    document, as ``DataCollatorWithFlattening`` and padding-free trainers produce them; Hugging Face
    builds a block-diagonal causal mask, and the kernel gets the documents as ``segment_ids``, so each
    query block reads only the key blocks of its own document;
  - padded batches, left or right padded (batched generation, padded fine-tuning batches): the kernel
    gets ids for the queries and the keys, padding keys with ids no query has, so their key blocks are
    skipped;
  - several queries over a cache (a prefill chunk, speculative tokens), with packed documents or
    padding too: Hugging Face's mask is the causal mask aligned to the queries' positions, the kernel's
    bottom-right aligned one;
  - sliding windows (Mistral, Gemma 2's local layers: the module's ``sliding_window``) shorter than the
    sequence, with any of the above: the mask is checked against the window as well, and the kernel
    runs with ``window=``, reading only the key blocks inside each query block's windows.

Soft-capped logits (Gemma 2's ``softcap``, ``c·tanh(s/c)``) run the kernel with ``softcap=``. Attention
sinks (GPT-OSS's ``s_aux``: a learned logit per head that joins each row's softmax and attends to nothing)
run the kernel too: its output is rescaled by ``sigmoid(lse - sink)`` from the log-sum-exp it
returns, differentiably, so the sinks get their gradients; where the kernel does not run, the model's own
eager attention does (``sdpa`` has no sinks).

Head dims the kernel lacks run at the next one it takes, widened with zeros (queries and keys of 80 dims at
128, DeepSeek-V3's 192 at 256: zeros add nothing to q·k), and so do values narrower than the queries
(multi-head latent attention, DeepSeek-V2/V3: the values' zero columns give output columns that are cut off).
A sparse attention's selected keys (DeepSeek-V3.2's and GLM-5's indexers: ``indices``, each query's top-k keys) are
kept by the mask, as the model's eager attention keeps them, and run there. Everything else goes to ``sdpa`` with the
mask Hugging Face built: masks of other patterns (a padding hole in
the middle of a row, say), attention dropout in training, position biases, and head dims above 256 or dtypes
the kernel does not take; with sinks or soft-capping, which ``sdpa`` does not take, the model's own eager
attention.

Modules that ``parallelize(cp_group=)`` marked with a context-parallel group run
:func:`~tessel.parallel.context.ring_attention` over it instead (see :mod:`tessel.layers.hf`), GPT-OSS's sinks
included (``ring_attention(sinks=)``), and heads above 256 (Gemma 4's 512), whose ring blocks run in PyTorch.
Nothing here imports ``transformers`` until :func:`register_hf_attention` or the ``sdpa`` fallback runs.
"""

from __future__ import annotations

import functools
import math
import sys

import torch
from torch import nn

from ..kernels._memo import kept_on
from ..kernels.attention_inputs import HEAD_DIMS
from ..parallel.collectives import copy_to_tp
from ..parallel.comm import group_rank, group_size
from ..parallel.context import _apply_sinks, ring_attention
from ..parallel.context_shared import shared_keys_attention
from ..parallel.sharding import local_shard

__all__ = [
    "CP_GROUP_ATTR",
    "MLA_INDEXER_INPUTS",
    "MLA_INDEXER_QUERIES",
    "MLA_LATENT_PROJECTIONS",
    "MLA_LATENT_READERS",
    "PER_HEAD_PARAMETERS",
    "SEGMENT_IDS_KWARG",
    "SHARED_KEYS_ATTR",
    "SINKS_KWARG",
    "mask_segments",
    "mla_rope_dim",
    "mla_shared_key",
    "per_head_parameters",
    "register_hf_attention",
    "tessel_attention_forward",
]

# The attribute parallelize(cp_group=) sets on attention modules; tessel_attention_forward reads it.
CP_GROUP_ATTR = "tessel_cp_group"
# set on attention modules whose keys beyond the rank's tokens are held whole by every rank (DeepSeek-V4's compressed
# keys, the mask's last columns their bias): :func:`~tessel.parallel.context_shared.shared_keys_attention`
SHARED_KEYS_ATTR = "tessel_shared_keys"
# Mask entries compared at a time by mask_segments (bytes of the boolean chunk; 8x that for the row ids).
MASK_CHUNK_ENTRIES = 2**24
# The keyword argument through which a context-parallel model's base hands its attention modules the whole
# sequence's segment ids (packed documents; see tessel.layers.hf_context.packed_positions)
SEGMENT_IDS_KWARG = "tessel_segment_ids"
# The keyword argument through which GPT-OSS hands the attention its sinks: a learned logit per query head
# that joins each row's softmax and attends to nothing
SINKS_KWARG = "s_aux"
# The keyword argument through which a sparse attention (DeepSeek-V3.2's, GLM-5's) hands the attention the keys its
# indexer selected for each query, ``[B, Sq, k]``
INDICES_KWARG = "indices"


def mask_segments(mask, causal: bool, window: int | None = None):
    """Whether a Hugging Face attention mask is what flash attention computes with segment ids, and the ids.

    Args:
        mask: the mask an attention implementation receives: a boolean ``[B or 1, 1, Sq, Sk]`` tensor
            (``True`` attends) with ``Sq ≤ Sk``, the queries at the last ``Sq`` of ``Sk`` positions (a
            forward over a cache), is analysed; anything else (``None``, an additive float mask, a
            per-head mask) is not.
        causal: whether the module is causal: then query ``i`` (at position ``p = i + Sk - Sq``) must see
            exactly the keys ``j ≤ p`` that share its id.
        window: ``None``, or (with ``causal``) a sliding window: query ``i`` must see exactly the keys
            ``p - window < j ≤ p`` that share its id (Hugging Face's ``sliding_window``).

    Returns:
        ``(True, segment_ids)`` when every entry of ``mask`` is what
        :func:`~tessel.kernels.attention.flash_attention` computes with these ``segment_ids`` and
        ``causal`` (and ``window``); ``(False, None)`` for any other pattern. ``segment_ids`` is:

        - ``None`` when one run covers everything (the plain causal or full mask, over a cache too);
        - an int32 ``[B or 1, S]`` tensor, ``0, 1, …`` along each row, when queries and keys are the same
          tokens and each row is documents packed back to back;
        - an int32 pair ``(q_ids [B or 1, Sq], kv_ids [B or 1, Sk])`` otherwise: padding (padding keys get
          ids no query has; a query that sees no key at all, as left padding's do, an id no key has),
          queries over a cache of packed documents.

    The ids are derived from each query's first visible key (where a run of keys begins, unless the
    window put it there) and which keys anybody sees, then checked against the mask entry by entry, in
    row chunks of ``2**24`` entries. The result is kept on the mask tensor (recomputed if it is modified
    in place), so the layers of one forward, which share the mask, analyse it once (a mask made under
    ``torch.inference_mode`` has no version counter, and is analysed each time).
    """
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.ndim == 4 and mask.shape[1] == 1
            and 0 < mask.shape[2] <= mask.shape[3]):  # fmt: skip
        return False, None
    return kept_on(mask, ("mask_segments", bool(causal), window), lambda: _read_segments(mask, causal, window))


def _read_segments(mask: torch.Tensor, causal: bool, window: int | None):
    rows = mask[:, 0]  # [B, Sq, Sk]
    sq, sk = rows.shape[1:]
    step = max(1, MASK_CHUNK_ENTRIES // sk)
    chunks = [rows[:, i : i + step] for i in range(0, sq, step)]
    first = torch.cat([c.to(torch.uint8).argmax(-1) for c in chunks], dim=1)  # each query's first visible key
    sees = torch.cat([c.any(-1) for c in chunks], dim=1)
    seen = torch.stack([c.any(1) for c in chunks]).any(0)  # [B, Sk]: keys some query sees
    pos = torch.arange(sq, device=mask.device) + (sk - sq)  # the queries' positions among the keys
    key = torch.arange(sk, device=mask.device)
    # A run of keys begins at a query's first visible key, unless that is where the window cut the run
    begins = sees & (first > pos - window + 1) if window is not None else sees
    starts = torch.zeros(rows.shape[0], sk, dtype=torch.int32, device=mask.device)
    starts.scatter_add_(1, first, begins.to(torch.int32))
    run = (starts > 0).cumsum(1)  # [B, Sk]: 0 before the first run
    # keys after the last key anybody sees in their run (padding, documents nobody reads) match no query
    last_seen = torch.full((rows.shape[0], sk + 1), -1, dtype=torch.long, device=mask.device)
    last_seen.scatter_reduce_(1, run, torch.where(seen, key, -1).expand_as(run), "amax")
    unread = key > last_seen.gather(1, run)
    kv_ids = 3 * run + unread
    q_run = run.gather(1, first)
    # a query that sees nothing gets an id no key has, in order after the run of the queries before it
    before = torch.where(sees, q_run, 0).cummax(1).values
    q_ids = torch.where(sees, 3 * q_run, 3 * before + 2)
    if not bool((q_ids[:, 1:] >= q_ids[:, :-1]).all()):
        return False, None
    for i in range(0, sq, step):
        want = q_ids[:, i : i + step, None] == kv_ids[:, None, :]
        if causal:
            want &= pos[None, i : i + step, None] >= key[None, None, :]
        if window is not None:
            want &= pos[None, i : i + step, None] - key[None, None, :] < window
        if not torch.equal(want, rows[:, i : i + step]):
            return False, None
    if bool((q_ids == q_ids[:, :1]).all()) and bool((kv_ids == q_ids[:, :1]).all()):
        return True, None  # one run: the plain mask
    if sq == sk and torch.equal(q_ids, kv_ids):  # documents packed back to back: one id per token
        return True, (run - 1).to(torch.int32)
    return True, (q_ids.to(torch.int32), kv_ids.to(torch.int32))


def _decoding_keys(mask, sk: int) -> int | None:
    """For one query over ``sk`` keys: ``n`` when the boolean mask ``[B or 1, 1, 1, sk]`` lets every batch row
    see exactly the last ``n ≥ 1`` keys (a sliding window over a cache), else None. Read once per forward:
    kept on the mask, which the layers share."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape[1:]) != (1, 1, sk):
        return None
    return kept_on(mask, ("decoding_keys", sk), lambda: _read_decoding_keys(mask[:, 0, 0], sk))


def _rows(segments) -> int:
    return (segments[0] if isinstance(segments, tuple) else segments).shape[0]


def _expand_rows(segments, b: int):
    """The ids of a mask shared by the batch (``[1, …]``), as views over ``b`` rows."""
    if isinstance(segments, tuple):
        return tuple(ids.expand(b, -1) for ids in segments)
    return segments.expand(b, -1)


def _read_decoding_keys(rows: torch.Tensor, sk: int) -> int | None:
    n = int(rows[0].sum())
    last = torch.arange(sk, device=rows.device) >= sk - n
    return n if n > 0 and bool((rows == last).all()) else None


# ---------------------------------------------------------------------------------------------------- context parallel


def _ring_attention_forward(module: nn.Module, query, key, value, attention_mask, dropout: float, scaling: float | None,
                            causal: bool, cp_group, kwargs) -> tuple[torch.Tensor, None]:  # fmt: skip
    """tessel_attention_forward for a module marked with a context-parallel group of more than one rank."""
    c, length = group_size(cp_group), query.shape[2]

    def refuse(what: str):
        raise ValueError(f"{type(module).__name__} under context parallelism over {c} ranks: {what}")

    if kwargs.get(INDICES_KWARG) is not None:
        refuse("the keys a sparse attention's indexer selected (DeepSeek Sparse Attention's indices) are not "
               "supported")  # fmt: skip
    shared = None
    if getattr(module, SHARED_KEYS_ATTR, False) and key.shape[2] > length:  # compressed keys after the rank's own
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape[-1] != key.shape[2]:
            refuse(f"the {key.shape[2] - length} keys beyond this rank's {length} need their bias in the mask's last "
                   "columns")  # fmt: skip
        shared = (key[:, :, length:], value[:, :, length:], attention_mask[..., length:])
        key, value = key[:, :, :length], value[:, :, :length]
    if key.shape[2] != length:
        refuse(f"the keys must be this rank's {length} tokens, received {key.shape[2]} (decoding with a key-value "
               "cache is not supported)")  # fmt: skip
    window = kwargs.get("sliding_window")  # Hugging Face's: query i sees keys i - window < j ≤ i, as the ring's
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        refuse(f"sliding_window must be None or a positive int, received {window!r}")
    slides = window is not None  # the model's mask, if any, is then its window's over the local tokens
    window = window if window is not None and window < c * length else None  # as long as the sequence: none
    if window is not None and not causal:
        refuse(f"a sliding window ({window}) without the causal mask is not supported")
    # The model's hook refused padding; a mask built here is the model's own from the local view: the local
    # tokens' sliding window, which the ring replaces with the global one. Anything else is refused.
    if attention_mask is not None and not slides and shared is None:
        refuse("an attention mask is not supported: each batch row is one whole sequence, or documents packed "
               "into it that the model's position_ids delimit (restarting at each document)")  # fmt: skip
    if dropout and module.training:
        refuse(f"attention dropout ({dropout}) is not supported")
    if kwargs.get("position_bias") is not None:
        refuse("position biases are not supported")
    softcap = kwargs.get("softcap")
    if not _softcap_fits(softcap):
        refuse(f"softcap must be None or a finite number above 0, received {softcap!r}")
    sinks = kwargs.get(SINKS_KWARG)
    if not _sinks_fit(sinks, query):
        got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        refuse(f"attention sinks must be one float logit per query head on the queries' device, received {got}")
    segment_ids = kwargs.get(SEGMENT_IDS_KWARG)
    # heads wider than the kernels' run the ring's blocks in PyTorch (ring_attention's notes)
    width = _kernel_head_dim(query, value) or max(query.shape[-1], value.shape[-1])
    q, k, v = (_widened(t, width) for t in (query, key, value))
    if shared is not None:
        if not causal or segment_ids is not None or softcap is not None:
            refuse("keys held whole beside the sequence's (compressed keys) need the causal mask, one sequence per "
                   "row and no soft-capping")  # fmt: skip
        out_BHSD = shared_keys_attention(q, k, v, _widened(shared[0], width), _widened(shared[1], width), shared[2],
                                         cp_group, scale=_scale(scaling, query), window=window, sinks=sinks,
                                         deterministic=_deterministic(kwargs))  # fmt: skip
        return out_BHSD[..., : value.shape[-1]].transpose(1, 2), None
    out_BHSD = ring_attention(q, k, v, cp_group, causal=causal, scale=_scale(scaling, query), segment_ids=segment_ids,
                              window=window, softcap=None if softcap is None else float(softcap),
                              deterministic=_deterministic(kwargs), sinks=sinks)  # fmt: skip
    return out_BHSD[..., : value.shape[-1]].transpose(1, 2), None  # laid out [B, S, H, D] already


def _kernel_head_dim(query: torch.Tensor, value: torch.Tensor) -> int | None:
    """The head dim the kernels run ``query``/``key`` (dim ``d``) and ``value`` (dim ``dv``) at: the smallest they
    take that holds both, or None. Zeros widen the rest: they add nothing to q·k (the scale stays ``d``'s), and
    V's zero columns give output columns that are cut off (multi-head latent attention's ``dv < d``, head dims of
    80 or 96)."""
    need = max(query.shape[-1], value.shape[-1])
    return next((d for d in sorted(HEAD_DIMS) if d >= need), None)


def _widened(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _scale(scaling: float | None, query: torch.Tensor) -> float:
    return query.shape[-1] ** -0.5 if scaling is None else scaling


# ---------------------------------------------------------------------------------------------------- attention


def tessel_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:  # fmt: skip
    """A Hugging Face attention implementation running :func:`tessel.kernels.attention.flash_attention`.

    ``query [B, Hq, Sq, D]``, ``key``/``value [B, Hkv, Sk, D]`` → ``(attn_output [B, Sq, Hq, D], None)``.
    The kernel runs for a plain causal or full mask over equal query and key lengths, for one query over
    a key-value cache (sliced to the keys it sees), and for every boolean mask that :func:`mask_segments`
    reads as segment ids (packed documents, left or right padding, queries over a cache, any of them in
    the module's ``sliding_window`` if one is given: the kernel gets the ``segment_ids`` and the
    ``window``). Everything else is passed to Hugging Face's ``sdpa`` implementation with the same mask,
    so the result is the same: masks of other patterns, attention dropout, a position bias, and head dims
    or dtypes the kernel does not take (the model's eager attention where sinks or soft-capping, which
    ``sdpa`` does not take, are asked for). Soft-capped logits (``softcap``) run the kernel with it. The call's
    ``deterministic`` keyword (Hugging Face's for flash attention; default True) picks the kernel's backward:
    bit-reproducible, or with ``False`` the faster one that adds dQ up with atomics. A
    query that sees no key at all (left padding) gives 0, as torch's ``sdpa`` does. Attention sinks
    (``s_aux``, GPT-OSS) rescale the kernel's output by ``sigmoid(lse - sink)``.

    A module that ``parallelize(cp_group=)`` marked (context parallelism) runs
    :func:`~tessel.parallel.context.ring_attention` over the group instead, within the documents that
    the ``tessel_segment_ids`` keyword delimits (set by the model's hook from the whole sequence's
    ``position_ids``), and refuses with a ``ValueError`` what the ring does not compute (masks, caches,
    dropout, attention sinks).
    """
    from ..kernels.attention import flash_attention

    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    cp_group = getattr(module, CP_GROUP_ATTR, None)
    if cp_group is not None and group_size(cp_group) > 1:
        return _ring_attention_forward(module, query, key, value, attention_mask, dropout, scaling, causal, cp_group,
                                       kwargs)  # fmt: skip
    indices = kwargs.pop(INDICES_KWARG, None)
    if indices is not None:  # a sparse attention's selected keys: the mask keeps those alone (sdpa runs it)
        attention_mask = _selected_keys(attention_mask, indices, query, key, causal)
    kernel_ok = (
        # several queries over a cache need the mask (Hugging Face's is top-left aligned without one)
        (query.shape[2] == key.shape[2] or query.shape[2] == 1 or attention_mask is not None)
        and not (dropout and module.training)
        and kwargs.get("position_bias") is None
        and _softcap_fits(kwargs.get("softcap"))
        and _kernel_head_dim(query, value) is not None
        and query.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and query.shape[1] % key.shape[1] == 0
        and _sinks_fit(kwargs.get(SINKS_KWARG), query)
    )
    segments = window = None
    keys = _decoding_keys(attention_mask, key.shape[2]) if kernel_ok and query.shape[2] == 1 else None
    if keys is not None:
        # a decoding step that sees the cache's last keys (all of them, or a sliding window's): a slice of
        # the cache, without a mask (the split-KV kernel takes it)
        key, value = key[:, :, key.shape[2] - keys :], value[:, :, value.shape[2] - keys :]
    elif kernel_ok and attention_mask is not None:
        # Hugging Face builds no mask for plain causal attention; the mask it built is read as segment ids
        # (packed documents, padding, queries over a cache), within the module's sliding window if it has one
        window = kwargs.get("sliding_window")
        bites = isinstance(window, int) and not isinstance(window, bool) and 0 < window < key.shape[2] and causal
        window = window if bites else None
        if tuple(attention_mask.shape[2:]) == (query.shape[2], key.shape[2]):
            kernel_ok, segments = mask_segments(attention_mask, causal, window)
            kernel_ok = kernel_ok and (segments is None or _rows(segments) in (1, query.shape[0]))
        else:
            kernel_ok = False
    if not kernel_ok:
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    if segments is not None and _rows(segments) != query.shape[0]:  # one view for all layers (it keeps the tables)
        b, shared = query.shape[0], segments
        segments = kept_on(attention_mask, ("segments_for_batch", b), lambda: _expand_rows(shared, b))
    extra = {} if segments is None else {"segment_ids": segments}
    if window is not None:
        extra["window"] = window
    if kwargs.get("softcap") is not None:
        extra["softcap"] = float(kwargs["softcap"])
    sinks = kwargs.get(SINKS_KWARG)
    if sinks is not None:
        extra["return_lse"] = True
    width = _kernel_head_dim(query, value)
    q, k, v = (_widened(t, width) for t in (query, key, value))
    out_BHSD = flash_attention(q, k, v, causal=causal and query.shape[2] > 1, scale=_scale(scaling, query),
                               deterministic=_deterministic(kwargs), **extra)  # fmt: skip
    if sinks is not None:  # differentiable through lse, so the sinks and q, k get their gradients
        out_BHSD = _apply_sinks(*out_BHSD, sinks)
    return out_BHSD[..., : value.shape[-1]].transpose(1, 2).contiguous(), None


def _deterministic(kwargs) -> bool:
    """The call's ``deterministic`` (Hugging Face's keyword for flash attention's deterministic backward): True, the
    default, runs tessel's bit-reproducible backward; False the one that adds dQ up with atomics."""
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        return True
    if not isinstance(deterministic, bool):
        raise TypeError(f"tessel attention: deterministic must be a bool, received {type(deterministic).__name__}")
    return deterministic


def _softcap_fits(softcap) -> bool:
    """No soft-capping, or a cap the kernel takes: a finite number above 0."""
    return softcap is None or (isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
                               and math.isfinite(softcap) and softcap > 0)  # fmt: skip


def _sinks_fit(sinks, query: torch.Tensor) -> bool:
    """No sinks, or one float logit per query head on the query's device."""
    return sinks is None or (isinstance(sinks, torch.Tensor) and sinks.is_floating_point()
                             and tuple(sinks.shape) == (query.shape[1],) and sinks.device == query.device)  # fmt: skip


def _fallback(module: nn.Module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    """What the kernel does not compute: Hugging Face's ``sdpa`` implementation, or, for attention with sinks or
    logit soft-capping (which ``sdpa`` cannot take), the model's own eager attention, given the additive mask
    it expects."""
    if kwargs.get(SINKS_KWARG) is None and kwargs.get("softcap") is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"tessel attention: {type(module).__name__} passes attention sinks or soft-capping in a "
                         f"case the kernel does not run, and its module {type(module).__module__} has no "
                         "eager_attention_forward to run it instead")  # fmt: skip
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    if attention_mask is None and causal and query.shape[2] > 1:
        # the mask builder passes None for plain causal attention (sdpa's is_causal); eager needs it spelled out
        attention_mask = _causal_mask(query, key)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
        hidden = torch.finfo(query.dtype).min
        attention_mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(~attention_mask, hidden)
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _causal_mask(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``[1, 1, Sq, Sk]``: the queries, the last ``Sq`` of the ``Sk`` positions, each see the keys up to itself."""
    sq, sk = query.shape[2], key.shape[2]
    pos = torch.arange(sq, device=query.device)[:, None] + (sk - sq)
    return (torch.arange(sk, device=query.device)[None, :] <= pos)[None, None]


def _selected_keys(attention_mask, indices, query: torch.Tensor, key: torch.Tensor, causal: bool) -> torch.Tensor:
    """The mask of a sparse attention (DeepSeek-V3.2's, GLM-5's: its indexer's top-k keys ``indices [B, Sq, k]`` of
    each query) within ``attention_mask`` (a boolean or additive ``[B or 1, 1, Sq, Sk]``; None: causal or full), as
    the model's eager attention applies it."""
    b, sq, sk = query.shape[0], query.shape[2], key.shape[2]
    if not (isinstance(indices, torch.Tensor) and indices.dim() == 3 and tuple(indices.shape[:2]) == (b, sq)
            and not indices.is_floating_point()):  # fmt: skip
        got = f"{indices.dtype} {tuple(indices.shape)}" if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"tessel attention: indices (a sparse attention's selected keys) must be integers "
                         f"[batch={b}, queries={sq}, k], received {got}")  # fmt: skip
    selected = torch.zeros(b, sq, sk, dtype=torch.bool, device=query.device)
    selected = selected.scatter(-1, indices.long(), True)[:, None]
    if attention_mask is None:
        return selected & _causal_mask(query, key) if causal and sq > 1 else selected
    if attention_mask.dtype == torch.bool:
        return attention_mask & selected
    return attention_mask.masked_fill(~selected, torch.finfo(attention_mask.dtype).min)


def register_hf_attention() -> str:
    """Register :func:`tessel_attention_forward` with transformers as ``attn_implementation="tessel"``.

    Also registers a mask builder under the same name (:func:`_tessel_mask`): Hugging Face's ``sdpa`` one, ``None``
    for a plain causal mask, a boolean ``[B, 1, S, S]`` mask otherwise (packed sequences among them); for models that
    run eager attention alone, the eager one. Idempotent; returns ``"tessel"``. Use it with
    ``AutoModelForCausalLM.from_config(config, attn_implementation="tessel")`` or
    ``model.set_attn_implementation("tessel")``.
    """
    from transformers import AttentionInterface

    AttentionInterface.register("tessel", tessel_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers < 4.53 builds masks without a registry
        pass
    else:
        AttentionMaskInterface.register("tessel", _tessel_mask)
    return "tessel"


def _tessel_mask(*args, config=None, **kwargs):
    """The mask of ``attn_implementation="tessel"``: ``sdpa``'s, or, for a model that runs eager attention alone
    (DeepSeek-V4's, which extends the mask it receives with its compressed keys' bias, and drops that bias when the
    mask is None), the eager additive mask, which tessel's attention hands to the model's eager attention."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    build = eager_mask if config is not None and _eager_only(type(config)) else sdpa_mask
    return build(*args, config=config, **kwargs)


@functools.cache
def _eager_only(config_class: type) -> bool:
    """Whether the causal LM (or base model) of ``config_class`` declares neither sdpa, flash nor flex attention."""
    from transformers.models.auto import modeling_auto

    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, modeling_auto.MODEL_MAPPING):
        try:
            model_class = mapping[config_class]
        except (KeyError, ValueError):
            continue
        return not any(getattr(model_class, f"_supports_{k}", False) for k in ("sdpa", "flash_attn", "flex_attn"))
    return False


# ---------------------------------------------------------------------------------------------------- latent attention


# Multi-head latent attention's projections (Hugging Face's names): the replicated ones of its input to narrow latents,
# and the split ones that read those latents (its other split columns read its input: the queries without a query
# latent, Bailing's and HY-V4's output gates)
MLA_LATENT_PROJECTIONS = ("q_a_proj", "kv_a_proj_with_mqa")
MLA_LATENT_READERS = ("q_b_proj", "kv_b_proj", "q_gate_proj")
# a sparse attention's indexer (DeepSeek-V3.2's, GLM-5's): its projections of the block's input (its key, its heads'
# weights), and of the query latent (its queries)
MLA_INDEXER_INPUTS, MLA_INDEXER_QUERIES = ("wk", "weights_proj"), ("wq_b",)


def mla_rope_dim(model: nn.Module, name: str, projection: nn.Module) -> int:
    """The rotary width of multi-head latent attention's ``kv_a_proj_with_mqa`` ``name``: ``qk_rope_head_dim`` of
    its attention module, else of the model's config."""
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    rope = getattr(parent, "qk_rope_head_dim", getattr(getattr(model, "config", None), "qk_rope_head_dim", None))
    width = projection.out_features
    if not isinstance(rope, int) or isinstance(rope, bool) or not 0 < rope < width:
        raise ValueError(f"needs qk_rope_head_dim (on its attention module or the model's config) between 1 and "
                         f"out_features - 1 = {width - 1}, received {rope!r}")  # fmt: skip
    return rope


def mla_shared_key(out: torch.Tensor, rope_dim: int, tp_group) -> torch.Tensor:
    """``[latent | rotary key]`` of ``kv_a_proj_with_mqa``: the rotary key, shared by every head, enters this
    rank's heads only, so its gradient is summed over the group (``copy_to_tp``); the latent's is summed by
    the column-parallel ``kv_b_proj`` it feeds."""
    latent, key = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat([latent, copy_to_tp(key, tp_group)], dim=-1)


# ------------------------------------------------------------------------------------------------ per-head parameters

# Parameters of an attention module with one entry per query head (GPT-OSS's attention sinks): each rank
# keeps those of its heads
PER_HEAD_PARAMETERS = ("sinks",)


def per_head_parameters(
    parents: dict[str, nn.Module], tp_group, named: set[str] = frozenset()
) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """``(module, name, this rank's shard)`` of every per-head parameter (:data:`PER_HEAD_PARAMETERS`, and
    those a plan ``named``) of the attention modules ``parents`` (by name), whose heads are split over
    ``tp_group``; raises when one does not split."""
    t, r = group_size(tp_group), group_rank(tp_group)
    shards = []
    for parent_name, parent in parents.items():
        own = {n.rpartition(".")[2] for n in named if n.rpartition(".")[0] == parent_name}
        for name in sorted(set(PER_HEAD_PARAMETERS) | own):
            p = parent._parameters.get(name)
            if p is None or t == 1:
                continue
            # the heads' dim: the first of more than one entry (Kimi's A_log [1, 1, H, 1])
            dim = next((i for i, n in enumerate(p.shape) if n > 1), 0)
            if p.dim() == 0 or p.shape[dim] % t:
                raise ValueError(f"parallelize: {parent_name}.{name} of shape {list(p.shape)} holds one value (or "
                                 f"row) per query head or channel, which must split over {t} tensor-parallel "
                                 f"ranks")  # fmt: skip
            local = nn.Parameter(local_shard(p.detach(), dim, (p.shape[dim],), r, t).clone(),
                                 requires_grad=p.requires_grad)  # fmt: skip
            local.tensor_parallel, local.tp_dim, local.tp_parts = True, dim, (p.shape[dim],)
            shards.append((parent, name, local))
    return shards

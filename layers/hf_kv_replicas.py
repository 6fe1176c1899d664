"""Key and value heads fewer than the tensor-parallel ranks: each kv head replicated on the ranks whose query heads read
it, as Megatron-LM replicates them (Qwen2.5-7B's 4 kv heads over 8 ranks, Gemma 2B's one).

Over ``t`` ranks a Hugging Face attention of ``H`` query heads and ``Hkv < t`` kv heads (``t`` a multiple of ``Hkv``,
``H`` of ``t``) keeps on rank ``r`` its ``H/t`` query heads, as any split does, and a copy of the one kv head they
read, ``r // (t / Hkv)``. Its key and value projections become :class:`~tessel.layers.linear.ColumnParallelLinear`
layers whose rows are cut into ``Hkv`` chunks (``max_chunks``), each on ``t / Hkv`` ranks: separate ``k_proj`` and
``v_proj`` with ``max_chunks=(Hkv,)``; a fused ``[q; k; v]`` (Phi-3's ``qkv_proj``, a multi-query GPT-BigCode's
``c_attn`` or Falcon-7B's ``query_key_value``: ``[q | k | v]`` of one kv head) as one layer with ``(None, Hkv,
Hkv)``. In backward the copies' gradients are summed over the group. They are column layers like ``q_proj``: under
sequence parallelism they multiply the input the block's ring gathers once for all of them, and without it the three
share one op and one all-reduce of the input's gradient (:mod:`~tessel.layers.shared_input`).

The attention's counts become this rank's (:func:`replicated_updates`): its query heads, one kv head, and the query
heads per kv head (``num_key_value_groups``) its forward repeats the keys by.
"""

from __future__ import annotations

from torch import nn

from .hf_classic import classic_qkv_parts
from .hf_mixers import packed_parts
from .hf_plans import LocalHeadsConfig, fused_qkv_parts, head_dim_of, positive_int_attr
from .plan import COLUMN, COLUMN_QKV, GRAD_ALL_REDUCE, ROW, Entry

__all__ = ["KV_PROJECTIONS", "fused_kv_replicas", "kv_replicas", "replicate_kv_heads", "replicated_updates"]

KV_PROJECTIONS = ("k_proj", "v_proj")
# what may sit beside replicated kv heads: split query and output projections (and a gate of the query heads), norms of
# one head's width (their gradients summed)
_BESIDE = {COLUMN, ROW, GRAD_ALL_REDUCE}
_QUERY_COUNTS = ("num_heads", "num_attention_heads")
_KV_COUNTS = ("num_key_value_heads", "num_kv_heads")


def _count(m: nn.Module, attrs: tuple[str, ...]) -> int | None:
    """The module's count (``attrs``), else its config's."""
    return positive_int_attr(m, attrs) or positive_int_attr(getattr(m, "config", None), attrs)


def kv_replicas(attention: nn.Module, t: int) -> int | None:
    """``Hkv`` when ``attention`` (``q_proj``, ``k_proj``, ``v_proj`` of ``nn.Linear``, a ``head_dim``) has fewer kv
    heads than the ``t`` ranks and they replicate evenly over them (``t % Hkv == 0``, ``H % t == 0``); else None.
    ``Hkv`` is read from ``k_proj``'s width (MiMo-V2-Flash's sliding layers have twice its config's), the values may
    have a head width of their own (its ``v_head_dim``)."""
    heads, head_dim = _count(attention, _QUERY_COUNTS), head_dim_of(attention)
    projections = [getattr(attention, n, None) for n in ("q_proj", *KV_PROJECTIONS)]
    if heads is None or head_dim is None or not all(isinstance(p, nn.Linear) for p in projections):
        return None
    q, k, v = projections
    kv_heads, rest = divmod(k.out_features, head_dim)
    # q_proj: one head_dim a head, or two (Qwen3-Next's and Qwen3.5's: each head's query, then its output gate)
    if rest or not kv_heads or v.out_features % kv_heads:
        return None
    if q.out_features not in (heads * head_dim, 2 * heads * head_dim):
        return None
    return kv_heads if _replicate(heads, kv_heads, t) else None


def _replicate(heads, kv_heads, t: int) -> bool:
    return kv_heads < t and t % kv_heads == 0 and heads % t == 0


def fused_kv_replicas(attention: nn.Module, child: str, t: int) -> int | None:
    """``Hkv`` when ``attention``'s fused projection ``child`` is ``[q; k; v]`` of ``H`` query and ``Hkv`` kv heads of
    its ``head_dim`` (Phi-3's ``qkv_proj``, a multi-query GPT-BigCode's ``c_attn``) and the kv heads are fewer than
    the ``t`` ranks and replicate evenly over them; else None."""
    if packed_parts(attention, child) is not None:
        return None
    parts, head_dim = fused_qkv_parts(attention) or classic_qkv_parts(attention, child), head_dim_of(attention)
    if parts is None or head_dim is None or parts[1] != parts[2] or any(n % head_dim for n in parts):
        return None
    heads, kv_heads = parts[0] // head_dim, parts[1] // head_dim
    return kv_heads if _replicate(heads, kv_heads, t) else None


def replicated_updates(attention: nn.Module, t: int) -> dict[str, object]:
    """The head counts of ``attention`` (:func:`kv_replicas`) on each of ``t`` ranks: ``H/t`` query heads, one kv
    head, ``H/t`` query heads reading it (and a view of Phi-3's config that says so)."""
    heads = _count(attention, _QUERY_COUNTS)
    updates = {attr: heads // t for attr in _QUERY_COUNTS if isinstance(getattr(attention, attr, None), int)}
    updates |= {attr: 1 for attr in _KV_COUNTS if isinstance(getattr(attention, attr, None), int)}
    if isinstance(getattr(attention, "num_key_value_groups", None), int):
        updates["num_key_value_groups"] = heads // t
    head_dim = head_dim_of(attention)
    # widths of every query head, where a forward reads one (GPT-BigCode's split_size)
    for attr in ("hidden_size", "embed_dim", "all_head_size", "split_size"):
        if getattr(attention, attr, None) == heads * head_dim:
            updates[attr] = heads // t * head_dim
    if fused_qkv_parts(attention) is not None:  # Phi-3 slices q, k, v by its config's head counts
        updates["config"] = LocalHeadsConfig(attention.config, num_attention_heads=heads // t, num_key_value_heads=1)
    return updates


def replicate_kv_heads(model: nn.Module, entries: list[Entry], t: int) -> None:
    """The ``max_chunks`` that keep a copy of a kv head on each rank (:mod:`~tessel.layers.hf_kv_replicas`) for the
    ``colwise`` k_proj and v_proj, or the fused ``colwise_qkv`` projection, of attention whose kv heads are fewer than
    the ``t`` ranks (its query heads split)."""
    kinds = {e.name: e.kind for e in entries}
    for e in entries:
        parent, _, leaf = e.name.rpartition(".")
        siblings = {kind for name, kind in kinds.items() if name.rpartition(".")[0] == parent}
        if t < 2 or siblings - _BESIDE - {COLUMN_QKV}:  # a norm over every kv head's features (OLMo 2's k_norm)
            continue
        if e.kind == COLUMN_QKV and (kv_heads := fused_kv_replicas(model.get_submodule(parent), leaf, t)):
            e.max_chunks = (None, kv_heads, kv_heads)  # one fused layer, k and v copied
            continue
        if e.kind != COLUMN or leaf not in KV_PROJECTIONS or kinds.get(f"{parent}.q_proj") != COLUMN:
            continue
        if (kv_heads := kv_replicas(model.get_submodule(parent), t)) is not None:
            e.max_chunks = (kv_heads,)

"""``load_pretrained``: a Hugging Face checkpoint read into a model that ``parallelize`` split on the meta device, each
rank reading its own shards and nothing whole.

A model too large for one device is built without memory, split, then filled::

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    parallelize(model, dims.tp_group, sequence_parallel=True)
    load_pretrained(model, path, dims.tp_group)

Every parameter and persistent buffer is read from the checkpoint's safetensors files under its own name: one that
``parallelize`` split as this rank's blocks of it (its ``tp_dim`` slice of each fused part, the rows of its experts;
safetensors reads those slices from the file, never the whole tensor), any other whole. Buffers that checkpoints do
not hold (rotary frequencies) are computed by the model's own initialisation (transformers' ``_init_weights``), whole
where ``parallelize`` keeps this rank's share of them (Falcon-H1's multipliers), and refused by name where that leaves
them unset. The tensors are new ones on ``device``, in the model's dtype (or
``dtype``), with their tensor-parallel tags; parameters tied together stay one. Wrap the model in ``DDP`` or
``FSDP`` after loading it.

Checked before anything is read, and refused by name: a tensor without a key in the checkpoint, a key of another
shape than the model's (a config that is not the checkpoint's), keys the model does not use (unless
``strict=False``), a model not on the meta device.

tessel's GPT of Llama's design (:mod:`~tessel.layers.gpt_llama`) loads a Llama or Mistral checkpoint the same way,
``GPT(config, tp_group=..., device="meta")`` filled by ``load_pretrained(gpt, path, tp_group)``: its fused ``qkv``
and ``fc`` are read as the concatenations they are; the checkpoint's config must compute what the GPT's does (the
family, SiLU, the rotary base, the norms' epsilon, the window, untied embeddings), else it is refused by name.

Checkpoints that transformers converts as it loads them (its weight conversion) are read under the names it gives
their tensors, its operations applied lazily, so each rank still reads the slices of its own experts or features
only: renamed keys as they are, experts stored one by one as the tensor transformers stacks of them
(``MergeModulelist``), their gate and up side by side (``Concatenate``), a fused tensor cut into the model's
(``Split`` by the model's sizes, as LaraMini's ``in_proj`` and Sarvam-MoE's ``query_key_value``; ``Chunk`` evenly),
dims swapped (``Transpose``). Other operations (``Interleave``, a rotary permutation) are refused by name: load such
a model whole with ``from_pretrained`` and parallelize that. GPT-2's ``Conv1D`` weights (``[in, out]``), which
``parallelize`` splits as the ``nn.Linear`` weights (``[out, in]``) they compute, are read transposed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from pathlib import Path

import torch
from torch import nn

from ..parallel.comm import group_rank, group_size
from ..parallel.sharding import expert_spec, global_shape, is_tp_sharded, tp_chunks, tp_spec
from .gpt import GPT
from .gpt_llama import check_llama_config, llama_names
from .meta import derived_buffers, is_meta

__all__ = ["load_pretrained"]


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """Each key of the checkpoint under ``path`` and the safetensors file that holds it."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {key: path / name for key, name in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"load_pretrained: path must be a directory of safetensors files (a Hugging Face "
                         f"checkpoint), received {path}")  # fmt: skip
    keys = {}
    for file in files:
        with safe_open(file, "pt") as f:
            keys.update(dict.fromkeys(f.keys(), file))
    return keys


class _Files:
    """The checkpoint's safetensors files, each opened once while the model loads."""

    def __init__(self, stack: contextlib.ExitStack):
        self.stack, self.open = stack, {}

    def slice(self, file: Path, key: str):
        from safetensors import safe_open

        if file not in self.open:
            self.open[file] = self.stack.enter_context(safe_open(file, "pt"))
        return self.open[file].get_slice(key)


class _Stored:
    """A tensor of the checkpoint, read by slices."""

    def __init__(self, files: _Files, file: Path, key: str):
        self.files, self.file, self.key, self.keys = files, file, key, {key}
        self.shape = tuple(files.slice(file, key).get_shape())

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.files.slice(self.file, self.key)[index]


class _Stacked:
    """Tensors of one shape stacked along a new first dim (transformers' ``MergeModulelist(dim=0)``: experts)."""

    def __init__(self, parts: list):
        shapes = {p.shape for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"load_pretrained: experts of different shapes {sorted(shapes)} cannot be stacked")
        self.parts, self.shape = parts, (len(parts), *parts[0].shape)
        self.keys = set().union(*(p.keys for p in parts))

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        chosen = range(*index[0].indices(len(self.parts)))
        return torch.stack([self.parts[i].read(index[1:]) for i in chosen])


class _Joined:
    """Tensors concatenated along ``dim`` (transformers' ``Concatenate``: gate beside up)."""

    def __init__(self, parts: list, dim: int):
        self.parts, self.dim = parts, dim
        self.shape = (*parts[0].shape[:dim], sum(p.shape[dim] for p in parts), *parts[0].shape[dim + 1 :])
        self.keys = set().union(*(p.keys for p in parts))

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        start, stop, _ = index[self.dim].indices(self.shape[self.dim])
        pieces, offset = [], 0
        for part in self.parts:
            lo, hi = max(start, offset), min(stop, offset + part.shape[self.dim])
            if lo < hi:
                pieces.append(part.read((*index[: self.dim], slice(lo - offset, hi - offset), *index[self.dim + 1 :])))
            offset += part.shape[self.dim]
        return torch.cat(pieces, self.dim)


def _transforms(model: nn.Module):
    """transformers' weight conversion for ``model``'s family: ``(renamings, converters, the functions)``, or None
    where this transformers has none."""
    try:
        from transformers import core_model_loading as core
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, core.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, core.WeightConverter)]
    return renamings, converters, core


class _Narrowed:
    """One piece of a stored tensor along ``dim`` (transformers' ``Split``/``Chunk``: a fused tensor cut into the
    model's), read as the slices of the piece it is."""

    def __init__(self, whole, dim: int, start: int, size: int):
        self.whole, self.dim, self.start, self.keys = whole, dim, start, whole.keys
        self.shape = (*whole.shape[:dim], size, *whole.shape[dim + 1 :])

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        lo, hi, _ = index[self.dim].indices(self.shape[self.dim])
        shifted = slice(self.start + lo, self.start + hi)
        return self.whole.read((*index[: self.dim], shifted, *index[self.dim + 1 :]))


class _Transposed:
    """A stored tensor with two dims swapped (transformers' ``Transpose``), read by the swapped slices."""

    def __init__(self, whole, dim0: int, dim1: int):
        self.whole, self.dims, self.keys = whole, (dim0, dim1), whole.keys
        shape = list(whole.shape)
        shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
        self.shape = tuple(shape)

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        swapped, (a, b) = list(index), self.dims
        swapped[a], swapped[b] = index[b], index[a]
        return self.whole.read(tuple(swapped)).transpose(a, b)


def _cut(whole, dim: int, sizes: list[int]) -> list[_Narrowed]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [_Narrowed(whole, dim, start, size) for start, size in zip(starts, sizes)]


def _sources_of(converter, matched: list[tuple[str, str, str]], files: _Files, where: dict[str, Path], core):
    """The lazy tensor of each source pattern: its stored tensor, or with ``MergeModulelist(dim=0)`` first, its
    experts stacked by their index in the key. None where a pattern has no such reading."""
    merge = type(converter.operations[0]) is core.MergeModulelist and converter.operations[0].dim == 0
    lazies = []
    for pattern in converter.source_patterns:
        keys = [(renamed, key) for p, key, renamed in matched if p == pattern]
        if not merge:
            if len(keys) != 1:
                return None
            lazies.append(_Stored(files, where[keys[0][1]], keys[0][1]))
            continue
        # the pattern as transformers reads it (a regex, ``*`` any run), the expert's index where its last ``*`` is
        head, star, tail = pattern.lstrip("^").rpartition("*")
        expert = re.compile(head.replace("*", r"\d+") + r"(\d+)" + tail if star else "(?!)")
        hits = [(expert.search(renamed), key) for renamed, key in keys]
        if not hits or any(hit is None for hit, _ in hits):  # the index of each expert, from the renamed key
            return None
        found = sorted((int(hit.group(1)), key) for hit, key in hits)
        if [i for i, _ in found] != list(range(len(found))):
            return None
        lazies.append(_Stacked([_Stored(files, where[key], key) for _, key in found]))
    return lazies, merge


def _converted(converter, targets: list[str], matched, files: _Files, where: dict[str, Path], core,
               shapes: dict[str, tuple[int, ...]]) -> dict | None:  # fmt: skip
    """``{target name: lazy tensor}`` that a converter makes of its ``(source pattern, key, renamed key)`` matches,
    its operations applied to the lazy tensors in order: experts stacked (``MergeModulelist``), tensors concatenated
    (``Concatenate``), a fused tensor cut into the targets (``Split`` by the model's sizes, ``Chunk`` evenly), dims
    swapped (``Transpose``). None where tessel does not read the conversion by slices."""
    ops = converter.operations
    found = _sources_of(converter, matched, files, where, core) if ops and len(set(targets)) == len(targets) else None
    if found is None:
        return None
    current, merged = found
    for op in ops[1:] if merged else ops:
        kind, dim = type(op), getattr(op, "dim", 0)
        if kind is core.Concatenate and getattr(op, "num_shards_attribute", None) is None:
            current = [current[0] if len(current) == 1 else _Joined(current, dim % len(current[0].shape))]
        elif kind in (core.Split, core.Chunk) and len(current) == 1 and len(targets) > 1:
            whole, dim = current[0], dim % len(current[0].shape)
            if kind is core.Chunk:
                if op.num_shards_attribute is not None or whole.shape[dim] % len(targets):
                    return None
                sizes = [whole.shape[dim] // len(targets)] * len(targets)
            else:
                if any(target not in shapes for target in targets):
                    return None
                sizes = [shapes[target][dim] for target in targets]
                if sum(sizes) != whole.shape[dim]:
                    raise ValueError(f"load_pretrained: the checkpoint's {sorted(whole.keys)[0]} is {whole.shape}, "
                                     f"the model's {targets} make {sum(sizes)} along dim {dim} (not the checkpoint's "
                                     "config?)")  # fmt: skip
            current = _cut(whole, dim, sizes)
        elif kind is core.Transpose and len(current) == 1 and len(targets) == 1:
            a, b = (d % len(current[0].shape) for d in (op.dim0, op.dim1))
            if not (op.check_dims and current[0].shape == shapes.get(targets[0])):  # stored as the model's: as is
                current = [_Transposed(current[0], a, b)]
        else:
            return None
    return dict(zip(targets, current)) if len(current) == len(targets) else None


def _gpt_sources(model: GPT, path: Path, where: dict[str, Path], files: _Files) -> dict:
    """tessel's GPT read from a Llama (Mistral) checkpoint: ``qkv`` as ``[q; k; v]``, ``fc`` as ``[gate; up]``."""
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"load_pretrained: a GPT loads a Llama or Mistral checkpoint with its config.json, which "
                         f"{path} lacks")  # fmt: skip
    try:
        check_llama_config(json.loads(config.read_text()), model.config)
    except ValueError as exc:
        raise ValueError(f"load_pretrained: {exc}") from None
    sources = {}
    for name, keys in llama_names(model.config).items():
        if all(k in where for k in keys):
            stored = [_Stored(files, where[k], k) for k in keys]
            sources[name] = stored[0] if len(stored) == 1 else _Joined(stored, 0)
    return sources


def _sources(model: nn.Module, path: Path, where: dict[str, Path], files: _Files,
             t: int) -> tuple[dict, dict[str, str]]:  # fmt: skip
    """``({model name: lazy tensor}, {model name: why it cannot be read})``: each checkpoint key under the name
    transformers gives it as it loads the checkpoint (renamed, or stacked and concatenated with others); for tessel's
    GPT, the Llama tensors each of its own is (:mod:`~tessel.layers.gpt_llama`)."""
    if isinstance(model, GPT):
        return _gpt_sources(model, path, where, files), {}
    found = _transforms(model)
    if found is None or not (found[0] or found[1]):
        return {key: _Stored(files, file, key) for key, file in where.items()}, {}
    renamings, converters, core = found
    names = dict.fromkeys(model.state_dict(keep_vars=True), True)
    prefix = getattr(model, "base_model_prefix", None)
    sources, groups, refused = {}, {}, {}
    for key in where:
        name, pattern = core.rename_source_key(key, renamings, converters, prefix, names)
        if name not in names and key in names:  # a key the rules should not have renamed (DeepSeek-V4's model.norm:
            name, pattern = core.rename_source_key(key, [], [], prefix, names)  # `.norm.` is its kv_norm), as HF does
        if pattern is None:
            sources[name] = _Stored(files, where[key], key)
        else:
            converter = next(c for c in converters if pattern in c.source_patterns)
            renamed = core.apply_renamings(key, renamings)  # the key the converter's pattern matched
            groups.setdefault((name, id(converter)), (converter, []))[1].append((pattern, key, renamed))
    shapes = {name: tuple(global_shape(p, t)) for p, names in _tensors(model) for name in names}
    for (name, _), (converter, matched) in groups.items():
        first = converter.target_patterns[0]
        targets = [name.replace(first, target) for target in converter.target_patterns]
        lazies = _converted(converter, targets, matched, files, where, core, shapes)
        if lazies is None:
            why = f"transformers converts it by {[type(op).__name__ for op in converter.operations]}"
            refused.update(dict.fromkeys(targets, why))
        else:
            sources.update(lazies)
    return sources, refused


def _blocks(p: torch.Tensor, t: int, r: int) -> tuple[int, list[tuple[slice, ...]]]:
    """``(dim, index tuples)``: the blocks of ``p``'s global tensor that make this rank's ``p``, concatenated along
    ``dim`` (its experts' rows, then each fused part's ``r``-th of ``t`` chunks along ``tp_dim``, or the chunk it
    holds a copy of)."""
    index = [slice(None)] * p.dim()
    experts = expert_spec(p)
    if experts is not None:
        index[0] = slice(experts[0], experts[0] + p.shape[0])
    if not is_tp_sharded(p):
        return 0, [tuple(index)]
    dim, parts = tp_spec(p, t)
    dim %= p.dim()
    blocks, offset = [], 0
    for n, c in zip(parts, tp_chunks(p, t)):  # a part cut into c < t chunks: chunk r·c/t
        j = r * c // t
        index[dim] = slice(offset + j * n // c, offset + (j + 1) * n // c)
        blocks.append(tuple(index))
        offset += n
    return dim, blocks


def _tensors(model: nn.Module) -> list[tuple[torch.Tensor, list[str]]]:
    """The model's parameters and persistent buffers, each once with all its names (tied ones have several)."""
    named: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        named.setdefault(id(t), (t, []))[1].append(name)
    return list(named.values())


def _plan(model, sources: dict, refused: dict[str, str], t: int) -> dict[str, tuple[torch.Tensor, object]]:
    """Each model tensor's lazy source, checked: present and of the global shape."""
    plan, missing = {}, []
    for p, names in _tensors(model):
        key = next((n for n in names if n in sources), None)
        if key is None:
            missing.append(names[0])
        else:  # GPT-2's Conv1D weights [in, out], which parallelize split as nn.Linear's [out, in]
            lazy = sources[key]
            plan[names[0]] = (p, _Transposed(lazy, 0, 1) if getattr(p, "hf_transposed", False) else lazy)
    if missing:
        why = next((f" ({n}: {refused[n]}, which tessel does not read by slices)" for n in missing if n in refused), "")
        raise ValueError(f"load_pretrained: the checkpoint has no tensor for {len(missing)} of the model's, e.g. "
                         f"{missing[:3]}{why}")  # fmt: skip
    for name, (p, lazy) in plan.items():
        want = tuple(global_shape(p, t))
        if lazy.shape != want:
            raise ValueError(f"load_pretrained: {name} is {want} in the model (whole), the checkpoint's "
                             f"{sorted(lazy.keys)[0]} makes {lazy.shape} (not the checkpoint's config?)")  # fmt: skip
    return plan


def _read(lazy, p: torch.Tensor, t: int, r: int) -> torch.Tensor:
    dim, blocks = _blocks(p, t, r)
    parts = [lazy.read(index) for index in blocks]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _replace(model: nn.Module, new: dict[int, torch.Tensor]) -> None:
    """Put each new tensor where the meta tensor of the same id was, in every module (tied ones alike)."""
    for m in model.modules():
        for slots in (m._parameters, m._buffers):
            for leaf, t in slots.items():
                if t is not None and id(t) in new:
                    slots[leaf] = new[id(t)]


def _init_buffers(model: nn.Module, device: torch.device) -> None:
    """The buffers left on the meta device (non-persistent: rotary frequencies, Falcon-H1's multipliers), computed by
    the model's own ``_init_weights``: on each module that holds one, then on its nearest ancestors while some are
    unset (Falcon-H1's model sets its layers'). A buffer ``parallelize`` derived from a whole one
    (:func:`~tessel.layers.meta.derived_buffer`) is computed whole, then cut to this rank's share. Refused by name
    where the initialisation leaves one unset."""
    init = getattr(model, "_init_weights", None)
    pending = []  # (holder's name, holder, buffer's name)
    for mod_name, m in model.named_modules():
        for leaf, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                shape, dtype, _ = derived_buffers(m).get(leaf, (b.shape, b.dtype, None))
                fill = float("nan") if dtype.is_floating_point else 0
                m._buffers[leaf] = torch.full(shape, fill, dtype=dtype, device=device)
                pending.append((mod_name, m, leaf))
    if init is not None:
        modules = dict(model.named_modules())
        with torch.no_grad():
            for name in dict.fromkeys(n for n, _, _ in pending):
                init(modules[name])
            for level in itertools.count():  # the nearest ancestors of the holders of buffers still unset, then theirs
                unset = {n for n, m, leaf in pending if _is_unset(m._buffers[leaf])}
                above = {chain[level] for chain in map(_ancestors, unset) if len(chain) > level}
                if not above:
                    break
                for name in sorted(above):
                    init(modules[name])
    unset = [f"{n}.{leaf}".lstrip(".") for n, m, leaf in pending if _is_unset(m._buffers[leaf])]
    if unset:
        raise ValueError(f"load_pretrained: the model's initialisation left the buffers {unset[:3]} unset (they are "
                         "not in the checkpoint): it cannot be loaded once split on the meta device")  # fmt: skip
    for _, m, leaf in pending:
        local_of = derived_buffers(m).get(leaf, (None, None, None))[2]
        if local_of is not None:  # computed whole: this rank's share of it
            m._buffers[leaf] = local_of(m._buffers[leaf]).clone()


def _ancestors(name: str) -> list[str]:
    """The names of the modules above the module ``name``, the nearest first, the model (``""``) last."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def _is_unset(b: torch.Tensor) -> bool:
    return b.is_floating_point() and bool(b.isnan().any())


def load_pretrained(model: nn.Module, path, tp_group=None, *, device=None, dtype: torch.dtype | None = None,
                    strict: bool = True) -> nn.Module:  # fmt: skip
    """Fill ``model`` (split by :func:`~tessel.layers.parallelize` on the meta device over ``tp_group``) from the
    Hugging Face checkpoint directory ``path``: see the module. ``device``: where the tensors go (default: the
    current CUDA device where there is one, else the CPU). ``dtype``: the floating-point tensors' (default: the
    model's). Returns ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_pretrained: model must be an nn.Module, received {type(model).__name__}")
    if not is_meta(model):
        raise ValueError("load_pretrained: model must be on the meta device (built under torch.device('meta') and "
                         "parallelized), received one whose tensors hold values")  # fmt: skip
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"load_pretrained: dtype must be a floating-point torch.dtype or None, received {dtype!r}")
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"load_pretrained: path must be a Hugging Face checkpoint directory, received {path}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"load_pretrained: device must be a torch.device or its name, received {device!r}") from None
    if device.type == "meta":
        raise ValueError("load_pretrained: device must hold values, received the meta device")
    if not isinstance(strict, bool):
        raise TypeError(f"load_pretrained: strict must be a bool, received {strict!r}")
    t, r = group_size(tp_group), group_rank(tp_group)
    where = _checkpoint_files(path)
    with contextlib.ExitStack() as stack:
        sources, refused = _sources(model, path, where, _Files(stack), t)
        plan = _plan(model, sources, refused, t)
        used = set().union(*(lazy.keys for _, lazy in plan.values()))
        if strict and used != where.keys():
            extra = sorted(where.keys() - used)
            raise ValueError(f"load_pretrained: the checkpoint holds {len(extra)} tensors the model does not use, "
                             f"e.g. {extra[:3]} (strict=False ignores them)")  # fmt: skip
        new = {}
        for name, (p, lazy) in plan.items():
            value = _read(lazy, p, t, r)
            if value.shape != p.shape:  # the blocks of a tag that does not describe the split
                raise ValueError(f"load_pretrained: {name}'s blocks make {tuple(value.shape)}, the model's is "
                                 f"{tuple(p.shape)}")  # fmt: skip
            target = dtype if dtype is not None and p.is_floating_point() else p.dtype
            value = value.to(device=device, dtype=target).contiguous()
            if isinstance(p, nn.Parameter):
                value = nn.Parameter(value, requires_grad=p.requires_grad)
                value.__dict__.update(p.__dict__)
            value._is_hf_initialized = True  # loaded: the model's initialisation of the buffers leaves it as it is
            new[id(p)] = value
    before = {id(new[id(p)]): p for p, _ in plan.values()}
    buffers = {(m, leaf): b for m in model.modules() for leaf, b in m._buffers.items() if b is not None and b.is_meta}
    _replace(model, new)
    try:
        _init_buffers(model, device)
    except Exception:  # the model as it was: every tensor on the meta device
        _replace(model, before)
        for (m, leaf), b in buffers.items():
            m._buffers[leaf] = b
        raise
    return model

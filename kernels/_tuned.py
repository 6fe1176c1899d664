"""Launching an autotuned kernel with less host work per call once its configuration is known.

``tuned[grid](*args, **kwargs)`` on a ``triton.autotune`` kernel runs Triton's ``Autotuner.run`` on every call:
it rebuilds dicts of every argument to find the call's key in its cache, even when the key was tuned long ago.
That costs about 8 microseconds of host time per launch on a CPU core (Triton 3.6 and 3.9, against launching
the picked configuration directly), and it is paid by every small GEMM: each step of the overlapped rings,
decode attention at every generated token. :func:`launch_tuned` computes the same key from the known positions
of the key's arguments, reads the autotuner's own cache, and launches the picked configuration straight on
the JIT function, as ``Autotuner.run`` does after its lookup. A key not tuned yet, and a configuration with a
pre-hook, take ``Autotuner.run`` itself, so tuning, its pruning and its hooks are untouched; a caller that
swaps the autotuner's configurations or cache (a tile sweep) is seen, since the live cache is read.
"""

from __future__ import annotations

import functools

__all__ = ["autotuner_key", "launch_tuned"]


@functools.cache
def _key_slots(tuned) -> tuple[int, ...]:
    """The positions, among the kernel's parameters, of the autotuner's key arguments, in the key's order."""
    position = {name: i for i, name in enumerate(tuned.arg_names)}
    return tuple(position[name] for name in tuned.keys)


@functools.cache
def _pointer_slots(tuned) -> tuple[int, ...]:
    """The positions of the kernel's pointer parameters (``*_ptr``: where tessel's launchers pass tensors)."""
    return tuple(i for i, name in enumerate(tuned.arg_names) if name.endswith("_ptr"))


@functools.cache
def _launch_kwargs(config) -> dict:
    """A configuration's meta-parameters and launch options (``Config.all_kwargs``), built once per config."""
    return config.all_kwargs()


def autotuner_key(tuned, args: tuple, kwargs: dict) -> tuple:
    """The key under which ``tuned`` (a ``triton.autotune`` kernel) caches its pick for this call, as its ``run``
    computes it (the key arguments present, positional or keyword, then the dtype of each tensor argument), for
    launches passing tensors positionally at the pointer parameters. Another call's key can differ from the
    autotuner's but never names another call's pick: it then misses, and :func:`launch_tuned` asks the autotuner."""
    names, n = tuned.arg_names, len(args)
    key = [args[i] if i < n else kwargs[names[i]] for i in _key_slots(tuned) if i < n or names[i] in kwargs]
    key += [str(args[i].dtype) for i in _pointer_slots(tuned) if i < n]
    return tuple(key)


def launch_tuned(tuned, grid, args: tuple, kwargs: dict) -> None:
    """``tuned[grid](*args, **kwargs)``: the same launch, through the autotuner only when it has work to do."""
    configs = tuned.configs
    config = tuned.cache.get(autotuner_key(tuned, args, kwargs)) if len(configs) > 1 else configs[0]
    if config is None or config.pre_hook is not None:
        tuned[grid](*args, **kwargs)  # tunes this key (or runs the configuration's hook), then launches
        return
    tuned.best_config = config  # what Autotuner.run records, read by the benchmarks' tile names
    tuned.fn[grid](*args, **kwargs, **_launch_kwargs(config))

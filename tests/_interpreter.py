"""Triton's interpreter, patched once per launch instead of at every call of a ``@triton.jit`` helper.

The interpreter runs a kernel with ``triton.language`` remapped onto numpy (``_patch_lang``): once when
the launch starts, and again at *every* call of a jit function from inside the kernel (tessel's helpers,
``tl.max``/``tl.sum`` and the other functions of ``triton.language.standard``). Each of those calls walks
the language modules with ``inspect.getmembers`` to re-wrap what the launch has already wrapped, and
in tessel's attention tests that is about a third of the interpreter's time: the helpers run in the
inner loops. A module the launch has patched is already remapped, so re-patching it changes nothing
(its builtins are wrappers by then, which are not re-wrapped; the other attributes are set to
equivalent closures). :func:`install` skips exactly those calls; a helper whose module brings another
language module still patches it, as before. The kernels compute the same values bit for bit
(``tests/kernels/test_interpreter_patch.py``).

Only tests use it: tessel itself never alters the interpreter. It installs nothing when this Triton's
interpreter is not built as described (the private names below), so a Triton that changes them runs
the tests as it ships, only slower.
"""

from __future__ import annotations

import inspect

_originals: dict[str, object] = {}  # what install() replaced, for uninstall()


def install() -> bool:
    """Make nested jit calls skip re-patching language modules the running launch has patched; True when
    installed (now or before), False when this Triton's interpreter does not match."""
    if _originals:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - depends on the Triton build
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    nested = getattr(interpreter, "InterpretedFunction", None)
    if original is None or scope_type is None or executor is None or nested is None:
        return False
    if "_patch_lang(self.fn)" not in inspect.getsource(nested.__call__) or "patch_scope.restore()" not in (
        inspect.getsource(executor.__call__)
    ):
        return False
    languages = (tl, tl.core)
    seen: dict[tuple[int, int], frozenset[int]] = {}  # a module's globals -> the language modules they name
    patched: set[int] = set()  # the language modules the running launch has patched
    launching = [False]

    def languages_of(fn) -> frozenset[int]:
        key = (id(fn.__globals__), len(fn.__globals__))
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages)
        return seen[key]

    def patch_lang(fn):
        names = languages_of(fn)
        if launching[0] and names <= patched:
            return scope_type()  # nothing to change, nothing to restore
        scope = original(fn)
        if launching[0]:
            patched.update(names)
        return scope

    launch = executor.__call__

    def run_launch(self, *args, **kwargs):
        launching[0] = True
        try:
            return launch(self, *args, **kwargs)
        finally:  # the launch has restored the language it patched
            launching[0] = False
            patched.clear()

    _originals.update(patch_lang=original, launch=launch)
    interpreter._patch_lang = patch_lang
    executor.__call__ = run_launch
    return True


def uninstall() -> None:
    """Put back what :func:`install` replaced (the interpreter as Triton ships it)."""
    if _originals:
        from triton.runtime import interpreter

        interpreter._patch_lang = _originals.pop("patch_lang")
        interpreter.GridExecutor.__call__ = _originals.pop("launch")

"""Triton's CPU interpreter (TRITON_INTERPRET=1): two mends, applied on import (every kernel module imports this).

1. triton < 3.8 beside numpy >= 2.4.
The interpreter holds a kernel's scalar arguments as one-element numpy arrays and reads one as an index
(a Python `range` bound: the kernels' key-block and row loops) with `int(array)`. numpy 2.4 refuses that
for arrays of ndim > 0 ("only 0-dimensional arrays can be converted to Python scalars"), so every kernel
with a runtime loop bound fails there. Triton 3.8 squeezes the array first (triton-lang/triton#9171);
importing this module applies the same one-line fix to the older interpreter. It touches the interpreter
only: compiled kernels never call `__index__`, and the kernels' code is the same on every version.

2. Speed, on every version. A kernel launch points triton.language's builtins at the interpreter's (triton's
`_patch_lang`, undone when the launch ends), and so does every call of a `@triton.jit` helper inside the
kernel, once per program and loop iteration, although the launch has already done it: each such call walks
the language modules with `inspect.getmembers` (1.6 ms), a fifth of the interpreted attention kernels' time.
Inside a launch that patched the same modules, a helper's call now patches nothing; what runs is the same.
"""

from __future__ import annotations

import inspect
import os

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def patch_interpreter_index() -> bool:
    """Give the interpreter's tensors a numpy-2.4-safe `__index__`; True when the patch is in place."""
    if not INTERPRET or _version(triton.__version__) >= (3, 8):
        return False
    from triton.runtime import interpreter  # lazy: needed only under TRITON_INTERPRET=1 on triton < 3.8

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "_tessera_squeezed", False):
        return patch_tensor is not None

    def squeezed(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    squeezed._tessera_squeezed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = squeezed
    return True


patch_interpreter_index()


def patch_once_per_launch() -> bool:
    """Make a `@triton.jit` helper's call inside an interpreted launch skip re-patching triton.language, when
    the launch patched the modules the helper sees; True when in place."""
    if not INTERPRET:
        return False
    import triton.language as tl  # lazy: with the interpreter only
    from triton.runtime import interpreter  # lazy: needed only under TRITON_INTERPRET=1

    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None:
        return False
    if getattr(patch_lang, "_tessera_once", False):
        return True
    patched: set[int] = set()  # the running launch's patched language modules; empty between launches

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def once(fn):
        seen = languages(fn)
        if patched and seen <= patched:
            return scope_type()  # a helper inside a launch that patched its modules: nothing to patch or undo
        scope = patch_lang(fn)
        if patched:  # a helper seeing other modules (triton.language.core: tl.max, tl.zeros): patched as triton
            patched.update(seen)  # does (never undone, as there), then not again in this launch
            return scope
        patched.update(seen)  # a launch (kernels launch no kernels): its patch is undone when it ends
        undo = scope.restore

        def restore() -> None:
            patched.clear()
            undo()

        scope.restore = restore
        return scope

    once._tessera_once = True  # type: ignore[attr-defined]
    interpreter._patch_lang = once
    return True


patch_once_per_launch()

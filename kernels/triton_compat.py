"""Triton's CPU interpreter (TRITON_INTERPRET=1) on triton < 3.8 beside numpy >= 2.4; imported by both kernels.

The interpreter holds a kernel's scalar arguments as one-element numpy arrays and reads one as an index
(a Python `range` bound: the kernels' key-block and row loops) with `int(array)`. numpy 2.4 refuses that
for arrays of ndim > 0 ("only 0-dimensional arrays can be converted to Python scalars"), so every kernel
with a runtime loop bound fails there. Triton 3.8 squeezes the array first (triton-lang/triton#9171);
importing this module applies the same one-line fix to the older interpreter. It touches the interpreter
only: compiled kernels never call `__index__`, and the kernels' code is the same on every version.
"""

from __future__ import annotations

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

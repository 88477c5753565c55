"""Compiled Triton reads no global of a kernel but a constexpr, a module, a type or another jitted function; the
CPU's interpreter reads any, so a kernel that passes every interpreted test can fail to compile on its first GPU
(the FP8 cast's rounding constant did, triton 3.6 on an H200, 2026-12-04). This walks every kernel's source, as
compiled Triton's code generator resolves names, and names what a GPU would refuse."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import tessera.kernels  # noqa: E402


def _python_function(obj: object) -> types.FunctionType | None:
    """The Python function under a jitted kernel (JITFunction, the interpreter's function, autotune and
    heuristics wrappers hold it as `.fn`), or None for anything else (a plain function among them)."""
    if isinstance(obj, types.FunctionType):
        return None
    while not isinstance(obj, types.FunctionType):
        if type(obj).__module__.split(".")[0] != "triton" or not hasattr(obj, "fn"):
            return None
        obj = obj.fn
    return obj


def kernels() -> dict[str, types.FunctionType]:
    found: dict[str, types.FunctionType] = {}
    for info in pkgutil.iter_modules(tessera.kernels.__path__):
        module = importlib.import_module(f"tessera.kernels.{info.name}")
        for name, obj in vars(module).items():
            fn = _python_function(obj)
            if fn is not None and fn.__module__ == module.__name__:
                found[f"{info.name}.{name}"] = fn
    return found


def refused_globals(fn: types.FunctionType) -> list[str]:
    """The global names `fn` loads whose values compiled Triton refuses: not a tl.constexpr, a module, a class,
    a function (jitted or builtin) or None."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    tree.body[0].decorator_list = []  # type: ignore[attr-defined]  # evaluated where the module runs, not compiled
    local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    refused = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Name) or not isinstance(node.ctx, ast.Load) or node.id in local:
            continue
        if node.id in fn.__globals__:
            value = fn.__globals__[node.id]
        elif hasattr(builtins, node.id):
            continue
        else:
            refused.append(f"{node.id} (undefined)")
            continue
        allowed = (
            value is None
            or isinstance(value, (tl.constexpr, types.ModuleType, type, types.BuiltinFunctionType))
            or _python_function(value) is not None
        )
        if not allowed:
            refused.append(f"{node.id} = {value!r} ({type(value).__name__})")
    return sorted(set(refused))


def test_the_walk_finds_every_kernel_module():
    names = kernels()
    for expected in (
        "triton_fp8_cast._scaled_cast_kernel",
        "triton_rmsnorm.",
        "triton_swiglu._swiglu_fwd_kernel",
        "triton_cross_entropy.",
        "triton_attention",
    ):
        assert any(n.startswith(expected) for n in names), (expected, sorted(names))


@pytest.mark.parametrize("name", sorted(kernels()))
def test_a_kernel_reads_only_globals_compiled_triton_reads(name):
    assert refused_globals(kernels()[name]) == [], f"{name}: make these tl.constexpr (compiled Triton refuses them)"


def test_a_plain_float_global_is_named():
    """The walk on the shape of the FP8 cast's bug: a module-level float read inside a kernel."""
    namespace: dict = {"tl": tl, "ROUNDER": 12582912.0, "OK": tl.constexpr(1.0)}
    source = "def kernel(X, N: tl.constexpr):\n    y = X + ROUNDER + OK\n    return y\n"
    exec(compile(source, "<test>", "exec"), namespace)  # noqa: S102 - the test's own source, not read from disk
    fn = namespace["kernel"]
    fn.__globals__.update(namespace)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(inspect, "getsource", lambda f: source)
        assert refused_globals(fn) == ["ROUNDER = 12582912.0 (float)"]

"""Compile every Triton kernel of tessera for Hopper (sm_90) ahead of time, in a process of its own: Triton's
interpreter (TRITON_INTERPRET=1, the CPU tests') patches triton.language for the process it runs in, and compiled
kernels must not meet those patches. Run by tests/test_triton_compile.py; prints one JSON object, each kernel's
name to "ok" or its error."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET: it compiles for the GPU"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tessera.kernels import triton_cross_entropy, triton_fp8_cast, triton_rmsnorm, triton_swiglu  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)

# each kernel, its argument types as the launches pass them (bf16 activations, fp32 statistics, i32 sizes and strides
# as Triton specializes small ones) and its constexprs as the launches set them
KERNELS = {
    "fp8_cast row": (
        triton_fp8_cast._scaled_cast_kernel,
        {"X": "*bf16", "S": "*fp32", "Y": "*fp8e4nv", **dict.fromkeys(["M", "N"], "i32"),
         **dict.fromkeys(["stride_xm", "stride_xn", "stride_sm", "stride_sn", "stride_ym", "stride_yn"], "i32")},
        {"MANTISSA": 3, "EMIN": -6, "FMAX": 448.0, "BLOCK_M": triton_fp8_cast.BLOCK_ROWS,
         "BLOCK_N": triton_fp8_cast.BLOCK_COLS},
    ),
    "fp8_cast e5m2 transposing": (
        triton_fp8_cast._scaled_cast_kernel,
        {"X": "*bf16", "S": "*fp32", "Y": "*fp8e5", **dict.fromkeys(["M", "N"], "i32"),
         **dict.fromkeys(["stride_xm", "stride_xn", "stride_sm", "stride_sn", "stride_ym", "stride_yn"], "i32")},
        {"MANTISSA": 2, "EMIN": -14, "FMAX": 57344.0, "BLOCK_M": triton_fp8_cast.TRANSPOSING_BLOCK,
         "BLOCK_N": triton_fp8_cast.TRANSPOSING_BLOCK},
    ),
    "rms_norm_fwd": (
        triton_rmsnorm._rms_norm_fwd_kernel,
        {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "RSTD": "*fp32", "AMAX": "*fp32", "stride_x": "i32",
         "stride_y": "i32", "N": "i32", "eps": "fp32"},
        {"BLOCK": 4096},
    ),
    "rms_norm_bwd": (
        triton_rmsnorm._rms_norm_bwd_kernel,
        {"DY": "*bf16", "X": "*bf16", "W": "*bf16", "RSTD": "*fp32", "DX": "*bf16", "DW_PARTIAL": "*fp32",
         **dict.fromkeys(["stride_dy", "stride_x", "stride_dx", "M", "N"], "i32")},
        {"BLOCK": 4096},
    ),
    "swiglu_fwd": (
        triton_swiglu._swiglu_fwd_kernel,
        {"G": "*bf16", "U": "*bf16", "H": "*bf16", "AMAX": "*fp32", "N": "i32"},
        {"BLOCK": triton_swiglu.CHUNK},
    ),
    "swiglu_bwd": (
        triton_swiglu._swiglu_bwd_kernel,
        {"DH": "*bf16", "G": "*bf16", "U": "*bf16", "DG": "*bf16", "DU": "*bf16", "N": "i32"},
        {"BLOCK": triton_swiglu.CHUNK},
    ),
    "cross_entropy row_stats": (
        triton_cross_entropy._row_stats_kernel,
        {"X": "*bf16", "ROW_MAX": "*fp32", "ROW_SUM": "*fp32", "stride_x": "i32", "V": "i32"},
        {"BLOCK": 4096},
    ),
    "cross_entropy grad": (
        triton_cross_entropy._grad_kernel,
        {"X": "*bf16", "TARGET": "*i64", "SCALE": "*fp32", "ROW_MAX": "*fp32", "ROW_SUM": "*fp32",
         "stride_x": "i32", "V": "i32"},
        {"BLOCK": 4096},
    ),
}  # fmt: skip


MODULES = (triton_fp8_cast, triton_rmsnorm, triton_swiglu, triton_cross_entropy)


def compile_all() -> dict[str, str]:
    out = {}
    for name, (kernel, signature, constexprs) in sorted(KERNELS.items()):
        names = [p.name for p in kernel.params]
        if set(names) != set(signature) | set(constexprs):
            out[name] = f"the table's arguments are not the kernel's ({names})"
            continue
        full = {p.name: ("constexpr" if p.is_constexpr else signature[p.name]) for p in kernel.params}
        try:
            compiled = triton.compile(ASTSource(kernel, full, constexprs), target=HOPPER)
            out[name] = "ok" if compiled.asm.get("cubin") else "no cubin"
        except Exception as e:  # noqa: BLE001 - each kernel's error is the finding
            out[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:800]
    tabled = {id(k) for k, _, _ in KERNELS.values()}
    for module in MODULES:
        for attr, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction) and id(value) not in tabled:
                out[f"{module.__name__}.{attr}"] = "not in the table: add its signature"
    return out


if __name__ == "__main__":
    print(json.dumps(compile_all()))
    sys.exit(0)

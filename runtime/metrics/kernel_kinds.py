"""What a profiled kernel (or CPU operator) is: an explicit table of name patterns, each with the kind the step
profile sums it under and what it is, tested against every kernel name of the committed H200 profiles
(tests/test_step_profile.py).

The first row whose pattern matches a kernel's name wins; a generic name (torch's `elementwise_kernel`) falls to
the tessera range it ran under (the loss, the clip, the optimizer), then to the copies' rows, then to the
operator that launched it. Word
boundaries matter: torch names its plain elementwise loop `gpu_kernel_impl_nocast`, and a bare `cast` pattern
counted every fp32 multiply (RoPE's, FP8's scaling) as a cast.
"""

from __future__ import annotations

import re
from typing import Sequence

KINDS = (
    "matmul",
    "attention",
    "norms",
    "other_elementwise",
    "loss",
    "optimizer_and_clipping",
    "casts_and_copies",
    "communication",
)
# the ranges the trainer and the loss head open around their work (torch.profiler.record_function)
LOSS_RANGE, CLIP_RANGE, OPTIMIZER_RANGE, STEP_RANGE = (
    "tessera: loss",
    "tessera: clip",
    "tessera: optimizer",
    "tessera: profiled step",
)
RANGE_NAMES = (LOSS_RANGE, CLIP_RANGE, OPTIMIZER_RANGE)

# (kind, what it is, pattern over the lower-cased kernel name): the first match wins
KERNEL_TABLE: tuple[tuple[str, str, str], ...] = (
    ("communication", "collective", r"nccl|all_?reduce|all_?gather|reduce_?scatter|sendrecv|c10d|gloo|broadcast"),
    # cuDNN's attention backward starts with its dot(dO, O) kernel, named apart from the attention's own
    ("attention", "attention", r"flash|fmha|attn|attention|sdpa|scaled_dot_product|compute_dot_do_o"),
    (
        "matmul",
        "GEMM",
        r"gemm|nvjet|cutlass|xmma|cublas|wgmma|gemv|matmul|aten::(mm|addmm|bmm|baddbmm|linear|_grouped_mm)\b",
    ),
    ("optimizer_and_clipping", "fused AdamW", r"fusedoptimizertensorlistmetadata|_fused_adam"),
    # the clip's foreach norm and scale (the optimizer's, where a range says so)
    ("optimizer_and_clipping", "foreach (clip)", r"multi_tensor_apply_kernel|lpnormfunctor|_foreach_"),
    ("norms", "norm", r"rms_?norm|layer_?norm|group_?norm|batch_?norm|rsqrt"),  # rsqrt: inductor's fused norms
    # FP8: the cast to float8 (torch's copy kernel, inductor's fusion of it into its producer, or tessera's
    # one-pass cast, kernels/triton_fp8_cast.py), the clamp into its range, and the amax its scale comes from
    ("casts_and_copies", "FP8 cast", r"float8_copy|scaled_mm\w*to_copy|to_copy\w*scaled_mm|_scaled_cast_kernel"),
    ("casts_and_copies", "FP8 clamp", r"launch_clamp_scalar"),
    # (torch.linalg.vector_norm(ord=inf)'s one reduction, the fused cast's amax, is AbsMaxOps)
    ("casts_and_copies", "FP8 amax", r"absfunctor|maxnanfunctor|fused_abs_max|absmaxops"),
)
# copies, after the ranges: a copy inside the loss (its fp32 upcast) is the loss's work, one outside any range
# is a cast or FSDP2's packing
COPY_TABLE: tuple[tuple[str, str, str], ...] = (
    # FSDP2's copy-in (the all-gather's input packed) and copy-out, and the reduce-scatter's
    ("casts_and_copies", "FSDP2 copy-in/out", r"chunk_cat|catarraybatchedcopy|split_with_sizes_copy"),
    ("casts_and_copies", "cast or copy", r"bfloat16_copy|direct_copy_kernel|\bcopy_kernel"),
    ("casts_and_copies", "memcpy/memset", r"\bmemcpy|\bmemset"),
)
# the kinds tessera's ranges give a generic kernel launched inside them
BY_RANGE = ((LOSS_RANGE, "loss"), (CLIP_RANGE, "optimizer_and_clipping"), (OPTIMIZER_RANGE, "optimizer_and_clipping"))
# the launching operator's name (and a CPU operator's own): (kind, pattern)
BY_OP: tuple[tuple[str, str], ...] = (
    ("optimizer_and_clipping", r"adam|_foreach_|multi_tensor|vector_norm|clip_grad"),
    ("loss", r"cross_entropy|nll_loss|log_softmax|logsumexp"),
    (
        "casts_and_copies",
        r"copy|_to_copy|aten::to\b|contiguous|clone|aten::cat\b|stack|memcpy|memset|fill_|zero_|\bcast\b",
    ),
)
_TABLE = tuple((kind, what, re.compile(pattern)) for kind, what, pattern in KERNEL_TABLE)
_COPIES = tuple((kind, what, re.compile(pattern)) for kind, what, pattern in COPY_TABLE)
_OPS = tuple((kind, re.compile(pattern)) for kind, pattern in BY_OP)


def by_name(kernel: str, table: tuple = _TABLE) -> tuple[str, str] | None:
    """(kind, what it is) of the table's first row matching the kernel's name; None for a generic name."""
    low = kernel.lower()
    for kind, what, pattern in table:
        if pattern.search(low):
            return kind, what
    return None


def kind_of(kernel: str, context: Sequence[str] = ()) -> str:
    """The kind of a kernel (or CPU operator) named `kernel`, launched under `context` (the launching
    operator and its enclosing ranges and operators, innermost first)."""
    named = by_name(kernel)
    if named is not None:
        return named[0]
    for name, kind in BY_RANGE:
        if name in context:
            return kind
    copied = by_name(kernel, _COPIES)
    if copied is not None:
        return copied[0]
    for text in (kernel.lower(), *(c.lower() for c in context)):
        for kind, pattern in _OPS:
            if pattern.search(text):
                return kind
        if text != kernel.lower():  # a generic kernel launched by a named op (aten::mm's "Kernel2")
            named = by_name(text)
            if named is not None:
                return named[0]
    return "other_elementwise"


def what_of(kernel: str, kind: str) -> str:
    """What a kernel is, as the top-kernels list says it: the table's row, else its kind in words."""
    named = by_name(kernel) or by_name(kernel, _COPIES)
    return named[1] if named is not None and named[0] == kind else kind.replace("_", " ")

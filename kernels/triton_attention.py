"""Flash attention in Triton: forward with the log-sum-exp, backward (dq, dk, dv), grouped-query heads.

FlashAttention-2's algorithm. Forward: one program per (query block, batch x query head) walks the key
blocks with an online softmax in the exp2 domain, and stores O and the natural-log LSE. Backward: a
dk/dv program per (key block, batch x kv head) loops over every query head of its group, so dk and dv
are summed over the shared heads without atomics; a separate dq program per query block walks the
keys. The softmax is recomputed from the LSE; the gradient of the LSE itself (which ring attention's
merge needs) enters through delta = rowsum(dO * O) - dLSE.

Both passes are torch.library custom ops with fake implementations, so torch.compile and meta-device
dry runs see shapes without running a kernel. On CPU tensors they run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import check_attention_inputs, check_documents
from .triton_compat import INTERPRET  # importing it also fixes triton < 3.8's interpreter

MAX_HEAD_DIM = 256  # any head dim up to this, powers of two or not (80, 96, 192: a padded, masked tile)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs a power of two of at least 16


LOG2E = 1.4426950408889634


def _configs(kind: str) -> list[triton.Config]:
    if INTERPRET:  # one small config: interpreted kernels are slow, and small blocks exercise the edges
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    if kind == "fwd":  # Hopper: large query tiles, pipelined key loads
        shapes = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4)]
    else:
        shapes = [(64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (32, 64, 4, 4), (64, 32, 4, 4)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


@triton.jit
def _id_range(ids, valid):
    """(lowest, highest) document id among a tile's valid lanes (ids are non-decreasing along a row)."""
    return tl.min(tl.where(valid, ids, 2147483647), 0), tl.max(tl.where(valid, ids, -2147483647), 0)


@triton.jit
def _ranges_meet(ids, valid, lo, hi):
    """Whether a tile's documents meet the range [lo, hi] of the other side's: else the tile is skipped."""
    tile_lo, tile_hi = _id_range(ids, valid)
    return (tile_hi >= lo) & (tile_lo <= hi)


@triton.autotune(configs=_configs("fwd"), key=["Sq", "Sk", "HEAD_DIM", "CAUSAL", "DOCS"])
@triton.jit
def _attention_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    QD,
    KD,
    qk_scale,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sob,
    soh,
    som,
    Hq,
    GROUP,
    Sq,
    Sk,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // Hq, pid_bh % Hq
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)  # the head dim padded to a power of two; lanes >= HEAD_DIM load as 0
    dm = d < HEAD_DIM
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqm + d[None, :], mask=(rows[:, None] < Sq) & dm[None, :], other=0.0
    )
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    diag = Sk - Sq  # bottom-right causal alignment: row i sees keys j <= i + diag
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, (pid_m + 1) * BLOCK_M + diag)
    if DOCS:  # this tile's documents: ids are non-decreasing, so a key tile outside [lo, hi] is skipped
        q_doc = tl.load(QD + b * Sq + rows, mask=rows < Sq, other=0)
        q_doc_lo, q_doc_hi = _id_range(q_doc, rows < Sq)
    for start in range(0, hi, BLOCK_N):
        cols = start + cols0
        run = start >= 0
        if DOCS:
            k_doc = tl.load(KD + b * Sk + cols, mask=cols < Sk, other=0)
            run = _ranges_meet(k_doc, cols < Sk, q_doc_lo, q_doc_hi)
        if run:
            kt = tl.load(k_base + cols[None, :] * skn + d[:, None], mask=(cols[None, :] < Sk) & dm[:, None], other=0.0)
            s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
            visible = cols[None, :] < Sk
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + diag)
            if DOCS:
                visible = visible & (q_doc[:, None] == k_doc[None, :])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * svn + d[None, :], mask=(cols[:, None] < Sk) & dm[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    empty = l_i == 0.0  # a query that sees no key (causal, Sk < Sq): output 0, lse -inf
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i / 1.4426950408889634 + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(
        O + b * sob + h * soh + rows[:, None] * som + d[None, :],
        acc.to(O.dtype.element_ty),
        mask=(rows[:, None] < Sq) & dm[None, :],
    )
    tl.store(LSE + pid_bh * Sq + rows, lse, mask=rows < Sq)


@triton.autotune(configs=_configs("bwd"), key=["Sq", "Sk", "HEAD_DIM", "CAUSAL", "DOCS"])
@triton.jit
def _attention_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    QD,
    KD,
    qk_scale,
    sm_scale,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdob,
    sdoh,
    sdom,
    Hq,
    Hkv,
    GROUP,
    Sq,
    Sk,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    b, hk = pid_bh // Hkv, pid_bh % Hkv
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows0 = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)  # the head dim padded to a power of two; lanes >= HEAD_DIM load as 0
    dm = d < HEAD_DIM
    k = tl.load(
        K + b * skb + hk * skh + cols[:, None] * skn + d[None, :], mask=(cols[:, None] < Sk) & dm[None, :], other=0.0
    )
    v = tl.load(
        V + b * svb + hk * svh + cols[:, None] * svn + d[None, :], mask=(cols[:, None] < Sk) & dm[None, :], other=0.0
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    diag = Sk - Sq
    lo = 0
    if CAUSAL:  # rows before (first column - diag) see none of these keys
        lo = tl.maximum(0, pid_n * BLOCK_N - diag)
        lo = (lo // BLOCK_M) * BLOCK_M
    if DOCS:  # this key tile's documents: a query tile outside [lo, hi] is skipped
        k_doc = tl.load(KD + b * Sk + cols, mask=cols < Sk, other=0)
        k_doc_lo, k_doc_hi = _id_range(k_doc, cols < Sk)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        stat = (b * Hq + h) * Sq
        for start in range(lo, Sq, BLOCK_M):
            rows = start + rows0
            in_rows = rows < Sq
            run = start >= 0
            if DOCS:
                q_doc = tl.load(QD + b * Sq + rows, mask=in_rows, other=0)
                run = _ranges_meet(q_doc, in_rows, k_doc_lo, k_doc_hi)
            if run:
                q = tl.load(q_base + rows[:, None] * sqm + d[None, :], mask=in_rows[:, None] & dm[None, :], other=0.0)
                do = tl.load(
                    do_base + rows[:, None] * sdom + d[None, :], mask=in_rows[:, None] & dm[None, :], other=0.0
                )
                lse2 = tl.load(LSE + stat + rows, mask=in_rows, other=0.0) * 1.4426950408889634
                delta = tl.load(DELTA + stat + rows, mask=in_rows, other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                visible = in_rows[:, None] & (cols[None, :] < Sk) & (lse2[:, None] != float("-inf"))
                if CAUSAL:
                    visible = visible & (cols[None, :] <= rows[:, None] + diag)
                if DOCS:
                    visible = visible & (q_doc[:, None] == k_doc[None, :])
                p = tl.where(visible, tl.exp2(s - tl.where(visible, lse2[:, None], 0.0)), 0.0)
                dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                ds = p * (dp - delta[:, None])
                dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    out = (b * Hkv + hk) * Sk * HEAD_DIM + cols[:, None] * HEAD_DIM + d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=(cols[:, None] < Sk) & dm[None, :])
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=(cols[:, None] < Sk) & dm[None, :])


@triton.autotune(configs=_configs("bwd"), key=["Sq", "Sk", "HEAD_DIM", "CAUSAL", "DOCS"])
@triton.jit
def _attention_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    QD,
    KD,
    qk_scale,
    sm_scale,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdob,
    sdoh,
    sdom,
    Hq,
    GROUP,
    Sq,
    Sk,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // Hq, pid_bh % Hq
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < Sq
    cols0 = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)  # the head dim padded to a power of two; lanes >= HEAD_DIM load as 0
    dm = d < HEAD_DIM
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqm + d[None, :], mask=in_rows[:, None] & dm[None, :], other=0.0
    )
    do = tl.load(
        DO + b * sdob + h * sdoh + rows[:, None] * sdom + d[None, :], mask=in_rows[:, None] & dm[None, :], other=0.0
    )
    lse2 = tl.load(LSE + pid_bh * Sq + rows, mask=in_rows, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + pid_bh * Sq + rows, mask=in_rows, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    diag = Sk - Sq
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, (pid_m + 1) * BLOCK_M + diag)
    if DOCS:
        q_doc = tl.load(QD + b * Sq + rows, mask=in_rows, other=0)
        q_doc_lo, q_doc_hi = _id_range(q_doc, in_rows)
    for start in range(0, hi, BLOCK_N):
        cols = start + cols0
        run = start >= 0
        if DOCS:
            k_doc = tl.load(KD + b * Sk + cols, mask=cols < Sk, other=0)
            run = _ranges_meet(k_doc, cols < Sk, q_doc_lo, q_doc_hi)
        if run:
            k = tl.load(k_base + cols[:, None] * skn + d[None, :], mask=(cols[:, None] < Sk) & dm[None, :], other=0.0)
            v = tl.load(v_base + cols[:, None] * svn + d[None, :], mask=(cols[:, None] < Sk) & dm[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            visible = in_rows[:, None] & (cols[None, :] < Sk) & (lse2[:, None] != float("-inf"))
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + diag)
            if DOCS:
                visible = visible & (q_doc[:, None] == k_doc[None, :])
            p = tl.where(visible, tl.exp2(s - tl.where(visible, lse2[:, None], 0.0)), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(
        DQ + pid_bh * Sq * HEAD_DIM + rows[:, None] * HEAD_DIM + d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=in_rows[:, None] & dm[None, :],
    )


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs keep full precision (no TF32)


def kernel_refusal(q: Tensor, v: Tensor | None = None) -> str | None:
    """Why the kernel cannot take these inputs (None: it can)."""
    if v is not None and v.shape[-1] != q.shape[-1]:
        return "a value head dim other than q's is not in the Triton attention kernel yet"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} is above the Triton attention kernel's {MAX_HEAD_DIM}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} is not supported by the Triton attention kernel (fp16, bf16, fp32)"
    return None


def check_kernel_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    check_attention_inputs(q, k, v)
    refusal = kernel_refusal(q)
    if refusal is not None:
        raise ValueError(f"{refusal}; use backend='torch'")
    if not q.is_cuda and not INTERPRET:
        raise ValueError(
            f"the Triton attention kernel needs CUDA tensors (got {q.device}); set TRITON_INTERPRET=1 before "
            f"importing to run it on CPU, or use backend='torch'"
        )


def _doc_args(q: Tensor, k: Tensor, q_docs: Tensor | None, k_docs: Tensor | None) -> tuple[Tensor, Tensor, bool]:
    """The kernels' document-id pointers (int32, contiguous); without documents two unused placeholders."""
    docs = check_documents(q, k, q_docs, k_docs)
    if docs is None:
        empty = torch.zeros(1, dtype=torch.int32, device=q.device)
        return empty, empty, False
    return docs[0].to(torch.int32).contiguous(), docs[1].to(torch.int32).contiguous(), True


@torch.library.custom_op("tessera::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty((B, Hq, Sq), device=q.device, dtype=torch.float32)
    qd, kd, docs = _doc_args(q, k, q_docs, k_docs)
    grid = lambda meta: (triton.cdiv(Sq, meta["BLOCK_M"]), B * Hq)  # noqa: E731
    _attention_fwd_kernel[grid](
        q,
        k,
        v,
        o,
        lse,
        qd,
        kd,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        Hq,
        Hq // Hkv,
        Sq,
        Sk,
        CAUSAL=causal,
        DOCS=docs,
        HEAD_DIM=D,
        BLOCK_D=_block_d(D),
        PRECISION=_precision(q.dtype),
    )
    return o, lse


@flash_attention_fwd.register_fake
def _(q, k, v, causal, scale, q_docs=None, k_docs=None):
    # contiguous, as the kernel writes them: empty_like would copy a transposed q's strides, and inductor
    # checks the real outputs' strides against these
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("tessera::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    dlse: Tensor,
    causal: bool,
    scale: float,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    # delta_i = sum_d dO_i,d O_i,d - dLSE_i: the row term of the softmax gradient (dLSE from ring merges)
    delta = ((do.float() * o.float()).sum(-1) - dlse.float()).contiguous()
    lse = lse.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    qd, kd, docs = _doc_args(q, k, q_docs, k_docs)
    common = (
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        do.stride(0),
        do.stride(1),
        do.stride(2),
    )
    prec = _precision(q.dtype)
    _attention_bwd_dkdv_kernel[lambda meta: (triton.cdiv(Sk, meta["BLOCK_N"]), B * Hkv)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        qd,
        kd,
        scale * LOG2E,
        scale,
        *common,
        Hq,
        Hkv,
        Hq // Hkv,
        Sq,
        Sk,
        CAUSAL=causal,
        DOCS=docs,
        HEAD_DIM=D,
        BLOCK_D=_block_d(D),
        PRECISION=prec,
    )
    _attention_bwd_dq_kernel[lambda meta: (triton.cdiv(Sq, meta["BLOCK_M"]), B * Hq)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dq,
        qd,
        kd,
        scale * LOG2E,
        scale,
        *common,
        Hq,
        Hq // Hkv,
        Sq,
        Sk,
        CAUSAL=causal,
        DOCS=docs,
        HEAD_DIM=D,
        BLOCK_D=_block_d(D),
        PRECISION=prec,
    )
    return dq, dk, dv


@flash_attention_bwd.register_fake
def _(do, q, k, v, o, lse, dlse, causal, scale, q_docs=None, k_docs=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the kernels write


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, q_docs, k_docs = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, q_docs, k_docs)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, do, dlse):
    q, k, v, o, lse, q_docs, k_docs = ctx.saved_tensors
    do = torch.zeros_like(o) if do is None else do
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    dq, dk, dv = flash_attention_bwd(do, q, k, v, o, lse, dlse, ctx.causal, ctx.scale, q_docs, k_docs)
    return dq, dk, dv, None, None, None, None


flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    scale: float | None = None,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
    window: int | None = None,
    q_offset: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) from the Triton kernels; differentiable in q, k, v (through out and lse). Document ids
    (B, Sq) and (B, Sk), as in tessera.kernels.flash_attention, mask each query to its own document."""
    check_kernel_inputs(q, k, v)
    if window is not None or q_offset is not None:
        raise ValueError("window and q_offset are not in the Triton attention kernel yet; use backend='torch'")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return flash_attention_fwd(q, k, v, causal, scale, q_docs, k_docs)


def attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    dlse: Tensor | None,
    causal: bool,
    scale: float,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
    window: int | None = None,
    q_offset: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one key block given the whole softmax's o and lse (ring attention's backward)."""
    if window is not None or q_offset is not None:
        raise ValueError("window and q_offset are not in the Triton attention kernel yet; use backend='torch'")
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    return flash_attention_bwd(do, q, k, v, o, lse, dlse, causal, scale, q_docs, k_docs)

"""The Triton flash-attention kernels themselves (FlashAttention-2); `triton_attention` wraps them in custom ops.

Forward: one program per (query block, batch x query head) walks the key blocks with an online softmax in
the exp2 domain, and stores O and the natural-log LSE. Backward: a dk/dv program per (key block, batch x kv
head) loops over every query head of its group, so dk and dv are summed over the shared heads without
atomics; a separate dq program per query block walks the keys. The softmax is recomputed from the LSE; the
gradient of the LSE itself (ring attention's merge, attention sinks) enters through delta = rowsum(dO * O) -
dLSE.

Query row i sits at key position i + q_off (Sk - Sq by default: bottom-right). CAUSAL hides keys after that
position, WINDOW those `window` or more before it; both bound the loops (a block no row of the tile can see
is never loaded) and mask inside. DOCS skips tiles whose documents do not meet and masks the rest. V's head
dim (V_DIM, padded to BLOCK_DV) may differ from q/k's (HEAD_DIM, padded to BLOCK_D).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_compat import INTERPRET  # importing it also fixes triton < 3.8's interpreter

MAX_HEAD_DIM = 256  # any head dim up to this, powers of two or not (80, 96, 192: a padded, masked tile)
LOG2E = 1.4426950408889634
KEY = ["Sq", "Sk", "HEAD_DIM", "V_DIM", "CAUSAL", "WINDOW", "DOCS"]  # what the autotuner's choice depends on


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs a power of two of at least 16


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


@triton.jit
def _key_bounds(
    first_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Sk,
    q_off,
    window,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """[lo, hi) of the key blocks the rows [first_row, first_row + BLOCK_M) may see; lo on a block edge."""
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, first_row + BLOCK_M + q_off)
    lo = 0
    if WINDOW:
        lo = tl.maximum(0, first_row + q_off - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def _seen(rows, cols, q_off, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """(rows, cols) pairs the causal and window rules leave visible (before bounds and documents)."""
    pos = rows[:, None] + q_off
    visible = cols[None, :] >= 0
    if CAUSAL:
        visible = visible & (cols[None, :] <= pos)
    if WINDOW:
        visible = visible & (pos - cols[None, :] < window)
    return visible


@triton.autotune(configs=_configs("fwd"), key=KEY)
@triton.jit
def _attention_fwd_kernel(
    Q, K, V, O, LSE, QD, KD, qk_scale,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
    Hq, GROUP, Sq, Sk, q_off, window,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // Hq, pid_bh % Hq
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)  # the head dims padded to powers of two; lanes past them load as 0
    dm = d < HEAD_DIM
    e = tl.arange(0, BLOCK_DV)
    em = e < V_DIM
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqm + d[None, :], mask=(rows[:, None] < Sq) & dm[None, :], other=0.0
    )
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, hi = _key_bounds(pid_m * BLOCK_M, BLOCK_M, BLOCK_N, Sk, q_off, window, CAUSAL, WINDOW)
    if DOCS:  # this tile's documents: ids are non-decreasing, so a key tile outside [lo, hi] is skipped
        q_doc = tl.load(QD + b * Sq + rows, mask=rows < Sq, other=0)
        q_doc_lo, q_doc_hi = _id_range(q_doc, rows < Sq)
    for start in range(lo, hi, BLOCK_N):
        cols = start + cols0
        run = start >= 0
        if DOCS:
            k_doc = tl.load(KD + b * Sk + cols, mask=cols < Sk, other=0)
            run = _ranges_meet(k_doc, cols < Sk, q_doc_lo, q_doc_hi)
        if run:
            kt = tl.load(k_base + cols[None, :] * skn + d[:, None], mask=(cols[None, :] < Sk) & dm[:, None], other=0.0)
            s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
            visible = (cols[None, :] < Sk) & _seen(rows, cols, q_off, window, CAUSAL, WINDOW)
            if DOCS:
                visible = visible & (q_doc[:, None] == k_doc[None, :])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * svn + e[None, :], mask=(cols[:, None] < Sk) & em[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    empty = l_i == 0.0  # a query that sees no key (causal, Sk < Sq; a window past the keys): output 0, lse -inf
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i / 1.4426950408889634 + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(
        O + b * sob + h * soh + rows[:, None] * som + e[None, :],
        acc.to(O.dtype.element_ty),
        mask=(rows[:, None] < Sq) & em[None, :],
    )
    tl.store(LSE + pid_bh * Sq + rows, lse, mask=rows < Sq)


@triton.autotune(configs=_configs("bwd"), key=KEY)
@triton.jit
def _attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QD, KD, qk_scale, sm_scale,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom,
    Hq, Hkv, GROUP, Sq, Sk, q_off, window,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    b, hk = pid_bh // Hkv, pid_bh % Hkv
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows0 = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)  # the head dims padded to powers of two; lanes past them load as 0
    dm = d < HEAD_DIM
    e = tl.arange(0, BLOCK_DV)
    em = e < V_DIM
    k = tl.load(
        K + b * skb + hk * skh + cols[:, None] * skn + d[None, :], mask=(cols[:, None] < Sk) & dm[None, :], other=0.0
    )
    v = tl.load(
        V + b * svb + hk * svh + cols[:, None] * svn + e[None, :], mask=(cols[:, None] < Sk) & em[None, :], other=0.0
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo = 0
    if CAUSAL:  # rows before (first column - q_off) see none of these keys
        lo = tl.maximum(0, pid_n * BLOCK_N - q_off)
        lo = (lo // BLOCK_M) * BLOCK_M
    hi = Sq
    if WINDOW:  # rows at or past (last column + window - q_off) see none of them either
        hi = tl.minimum(Sq, pid_n * BLOCK_N + BLOCK_N - 1 + window - q_off)
    if DOCS:  # this key tile's documents: a query tile outside [lo, hi] is skipped
        k_doc = tl.load(KD + b * Sk + cols, mask=cols < Sk, other=0)
        k_doc_lo, k_doc_hi = _id_range(k_doc, cols < Sk)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        stat = (b * Hq + h) * Sq
        for start in range(lo, hi, BLOCK_M):
            rows = start + rows0
            in_rows = rows < Sq
            run = start >= 0
            if DOCS:
                q_doc = tl.load(QD + b * Sq + rows, mask=in_rows, other=0)
                run = _ranges_meet(q_doc, in_rows, k_doc_lo, k_doc_hi)
            if run:
                q = tl.load(q_base + rows[:, None] * sqm + d[None, :], mask=in_rows[:, None] & dm[None, :], other=0.0)
                do = tl.load(
                    do_base + rows[:, None] * sdom + e[None, :], mask=in_rows[:, None] & em[None, :], other=0.0
                )
                lse2 = tl.load(LSE + stat + rows, mask=in_rows, other=0.0) * 1.4426950408889634
                delta = tl.load(DELTA + stat + rows, mask=in_rows, other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                visible = in_rows[:, None] & (cols[None, :] < Sk) & (lse2[:, None] != float("-inf"))
                visible = visible & _seen(rows, cols, q_off, window, CAUSAL, WINDOW)
                if DOCS:
                    visible = visible & (q_doc[:, None] == k_doc[None, :])
                p = tl.where(visible, tl.exp2(s - tl.where(visible, lse2[:, None], 0.0)), 0.0)
                dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                ds = p * (dp - delta[:, None])
                dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    kv_row = (b * Hkv + hk) * Sk + cols[:, None]
    tl.store(
        DK + kv_row * HEAD_DIM + d[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty),
        mask=(cols[:, None] < Sk) & dm[None, :],
    )
    tl.store(DV + kv_row * V_DIM + e[None, :], dv.to(DV.dtype.element_ty), mask=(cols[:, None] < Sk) & em[None, :])


@triton.autotune(configs=_configs("bwd"), key=KEY)
@triton.jit
def _attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QD, KD, qk_scale, sm_scale,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom,
    Hq, GROUP, Sq, Sk, q_off, window,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // Hq, pid_bh % Hq
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < Sq
    cols0 = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)  # the head dims padded to powers of two; lanes past them load as 0
    dm = d < HEAD_DIM
    e = tl.arange(0, BLOCK_DV)
    em = e < V_DIM
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqm + d[None, :], mask=in_rows[:, None] & dm[None, :], other=0.0
    )
    do = tl.load(
        DO + b * sdob + h * sdoh + rows[:, None] * sdom + e[None, :], mask=in_rows[:, None] & em[None, :], other=0.0
    )
    lse2 = tl.load(LSE + pid_bh * Sq + rows, mask=in_rows, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + pid_bh * Sq + rows, mask=in_rows, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_bounds(pid_m * BLOCK_M, BLOCK_M, BLOCK_N, Sk, q_off, window, CAUSAL, WINDOW)
    if DOCS:
        q_doc = tl.load(QD + b * Sq + rows, mask=in_rows, other=0)
        q_doc_lo, q_doc_hi = _id_range(q_doc, in_rows)
    for start in range(lo, hi, BLOCK_N):
        cols = start + cols0
        run = start >= 0
        if DOCS:
            k_doc = tl.load(KD + b * Sk + cols, mask=cols < Sk, other=0)
            run = _ranges_meet(k_doc, cols < Sk, q_doc_lo, q_doc_hi)
        if run:
            k = tl.load(k_base + cols[:, None] * skn + d[None, :], mask=(cols[:, None] < Sk) & dm[None, :], other=0.0)
            v = tl.load(v_base + cols[:, None] * svn + e[None, :], mask=(cols[:, None] < Sk) & em[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            visible = in_rows[:, None] & (cols[None, :] < Sk) & (lse2[:, None] != float("-inf"))
            visible = visible & _seen(rows, cols, q_off, window, CAUSAL, WINDOW)
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

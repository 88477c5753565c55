"""Attention: `flash_attention(q, k, v, causal, scale, return_lse)` with a torch reference beside the kernel.

Shapes: q (B, Hq, Sq, D), k (B, Hkv, Sk, D) and v (B, Hkv, Sk, Dv) with Hq a multiple of Hkv (grouped-query
attention: query head h reads kv head h // (Hq // Hkv)); the output is (B, Hq, Sq, Dv) (Dv may differ from
D: DeepSeek-V3's MLA). Query row i sits at key position i + q_offset, q_offset = Sk - Sq by default (aligned
bottom-right, as in FlashAttention-2). Causal: query i sees key j when j <= i + q_offset; with Sq == Sk that
is the usual lower triangle. A sliding `window` W also hides keys W or more positions back:
(i + q_offset) - j < W (transformers' `sliding_window_causal_mask_function`: kv_idx > q_idx - W). The
log-sum-exp (natural log, float32 -- float64 for float64 inputs -- shape (B, Hq, Sq)) is what ring attention
needs to merge partial results, and what `apply_sinks` merges a sink logit into.

Three torch implementations live here; `tessera.kernels.dispatch` chooses between them and the Triton
kernel, in one place:
- `attention_reference`: blockwise over keys with an online softmax (the kernel's algorithm in plain
  differentiable torch), differentiable through the LSE too (ring attention's merge needs that);
- `sdpa_attention`: torch's fused CPU flash attention (ATen), the fast CPU path for training; its LSE
  is not differentiable, so it serves calls that do not ask for the LSE;
- `naive_attention`: softmax(q k^T) v with every head materialized, for checks.

`attention_backward_reference` is the backward of one key block given the softmax's output and LSE
(ring attention's backward calls it per block with the merged, global ones).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .checks import check_attention_inputs, check_documents

REFERENCE_BLOCK = 128


def _same_document(q_docs: Tensor, k_docs: Tensor) -> Tensor:
    """(B, 1, 1, Sq, Sk) True where query and key lie in one document (the grouped-head layout's dims)."""
    return (q_docs.unsqueeze(-1) == k_docs.unsqueeze(-2))[:, None, None]


def key_range(rows: tuple[int, int], Sk: int, causal: bool, window: int | None, q_offset: int) -> tuple[int, int]:
    """[lo, hi): the keys any query row in [rows[0], rows[1]) may see (query i at key position i + q_offset);
    the keys outside are skipped, not masked. lo >= hi: none."""
    hi = min(Sk, rows[1] + q_offset) if causal else Sk
    lo = 0 if window is None else max(0, rows[0] + q_offset - window + 1)
    return lo, hi


def _hidden(rows: Tensor, cols: Tensor, causal: bool, window: int | None) -> Tensor | None:
    """True where query (absolute position `rows`, a column) may not see key `cols` (a row); None: all seen."""
    hidden = None
    if causal:
        hidden = cols > rows
    if window is not None:
        far = rows - cols >= window
        hidden = far if hidden is None else hidden | far
    return hidden


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    scale: float | None = None,
    block: int = REFERENCE_BLOCK,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
    window: int | None = None,
    q_offset: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Blockwise attention in torch; returns (out in q's dtype, lse float32). Differentiable in q, k, v.
    With document ids (B, Sq) and (B, Sk) a query sees only keys of its own document. With a `window` the
    queries go by blocks too, each over only the key blocks its window reaches."""
    check_attention_inputs(q, k, v)
    docs = check_documents(q, k, q_docs, k_docs)
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hkv
    offset = Sk - Sq if q_offset is None else q_offset
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32 accumulation (fp64 stays fp64)
    # (B, Hkv, group, Sq, D): the query heads that share a kv head sit together, so k/v broadcast
    qf = q.to(acc_dtype).reshape(B, Hkv, group, Sq, D) * scale
    kf, vf = k.to(acc_dtype).unsqueeze(2), v.to(acc_dtype).unsqueeze(2)
    q_block = Sq if window is None else block  # without a window every query block reaches the same keys
    outs, lses = [], []
    for r0 in range(0, Sq, q_block):
        r1 = min(r0 + q_block, Sq)
        rows = torch.arange(r0, r1, device=q.device).view(-1, 1) + offset
        m = torch.full((B, Hkv, group, r1 - r0, 1), float("-inf"), device=q.device, dtype=acc_dtype)
        l = torch.zeros((B, Hkv, group, r1 - r0, 1), device=q.device, dtype=acc_dtype)
        acc = torch.zeros((B, Hkv, group, r1 - r0, Dv), device=q.device, dtype=acc_dtype)
        lo, hi = key_range((r0, r1), Sk, causal, window, offset)
        for start in range(lo, hi, block):
            stop = min(start + block, hi)
            s = qf[..., r0:r1, :] @ kf[..., start:stop, :].transpose(-1, -2)
            hidden = _hidden(rows, torch.arange(start, stop, device=q.device).view(1, -1), causal, window)
            if hidden is not None:
                s = s.masked_fill(hidden, float("-inf"))
            if docs is not None:
                s = s.masked_fill(~_same_document(docs[0][:, r0:r1], docs[1][:, start:stop]), float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            # rows with nothing visible yet keep m = -inf; shift by 0 there to avoid inf - inf
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe)
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + p @ vf[..., start:stop, :]
            m = m_new
        empty = l == 0  # queries that see no key at all (causal with Sk < Sq): output 0, lse -inf
        outs.append(torch.where(empty, torch.zeros_like(acc), acc / torch.where(empty, torch.ones_like(l), l)))
        lses.append(
            torch.where(
                empty, torch.full_like(m, float("-inf")), m + torch.log(torch.where(empty, torch.ones_like(l), l))
            )
        )
    out, lse = torch.cat(outs, dim=3), torch.cat(lses, dim=3)
    return out.reshape(B, Hq, Sq, Dv).to(q.dtype), lse.reshape(B, Hq, Sq)


def attention_backward_reference(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    dlse: Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    block: int = REFERENCE_BLOCK,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
    window: int | None = None,
    q_offset: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one attention block, given the output `o` and log-sum-exp `lse` of the softmax
    the block belongs to (FlashAttention-2's backward; ring attention passes the merged, global o and
    lse, so each key block's share of the gradient comes out exactly). Blockwise over keys (and over
    queries with a `window`, each query block over the keys its window reaches), fp32."""
    docs = check_documents(q, k, q_docs, k_docs)
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hkv
    offset = Sk - Sq if q_offset is None else q_offset
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)

    def grouped(t: Tensor) -> Tensor:  # (B, Hq, Sq, ...) -> (B, Hkv, group, Sq, ...)
        return t.to(acc).reshape(B, Hkv, group, *t.shape[2:])

    qf, dof, lsef = grouped(q), grouped(do), grouped(lse).unsqueeze(-1)
    delta = (dof * grouped(o)).sum(-1, keepdim=True)  # rowsum(dO * O) - dLSE: the softmax row term
    if dlse is not None:
        delta = delta - grouped(dlse).unsqueeze(-1)
    visible_rows = ~torch.isneginf(lsef)  # a query that sees no key has no gradient
    lse_safe = torch.where(visible_rows, lsef, torch.zeros_like(lsef))
    kf, vf = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    dq = torch.zeros_like(qf)
    dk = torch.zeros((B, Hkv, Sk, D), device=q.device, dtype=acc)
    dv = torch.zeros((B, Hkv, Sk, Dv), device=q.device, dtype=acc)
    q_block = Sq if window is None else block
    for r0 in range(0, Sq, q_block):
        r1 = min(r0 + q_block, Sq)
        rows = torch.arange(r0, r1, device=q.device).view(-1, 1) + offset
        qr, dor, delta_r = qf[..., r0:r1, :], dof[..., r0:r1, :], delta[..., r0:r1, :]
        lo, hi = key_range((r0, r1), Sk, causal, window, offset)
        for start in range(lo, hi, block):
            stop = min(start + block, hi)
            kb, vb = kf[..., start:stop, :], vf[..., start:stop, :]
            s = (qr @ kb.transpose(-1, -2)) * scale
            p = torch.exp(s - lse_safe[..., r0:r1, :]) * visible_rows[..., r0:r1, :]
            hidden = _hidden(rows, torch.arange(start, stop, device=q.device).view(1, -1), causal, window)
            if hidden is not None:
                p = p.masked_fill(hidden, 0.0)
            if docs is not None:
                p = p.masked_fill(~_same_document(docs[0][:, r0:r1], docs[1][:, start:stop]), 0.0)
            dv[..., start:stop, :] += (p.transpose(-1, -2) @ dor).sum(2)
            ds = p * (dor @ vb.transpose(-1, -2) - delta_r)
            dq[..., r0:r1, :] += (ds @ kb) * scale
            dk[..., start:stop, :] += (ds.transpose(-1, -2) @ qr).sum(2) * scale
    return dq.reshape(B, Hq, Sq, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def sdpa_attention_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool = True, scale: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """attention_backward_reference without an LSE gradient, by ATen's fused CPU flash-attention backward
    (the same conditions as sdpa_supports)."""
    group = q.shape[1] // k.shape[1]
    kr, vr = (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)) if group > 1 else (k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do.contiguous(),
        q.contiguous(),
        kr.contiguous(),
        vr.contiguous(),
        o.contiguous(),
        lse.to(torch.promote_types(q.dtype, torch.float32)).contiguous(),
        0.0,
        causal,
        scale=scale,
    )
    if group > 1:  # the repeated kv heads' gradients add up on their kv head
        B, Hkv, Sk, D = k.shape
        dk, dv = dk.view(B, Hkv, group, Sk, D).sum(2), dv.view(B, Hkv, group, Sk, D).sum(2)
    return dq, dk, dv


def naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    scale: float | None = None,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax(q k^T) v with every head materialized: the definition the other implementations are tested
    against. With document ids a query sees only its own document's keys; one that sees none gives 0 and
    lse -inf. A `window` hides keys `window` or more positions before the query (bottom-right aligned)."""
    docs = check_documents(q, k, q_docs, k_docs)
    group = q.shape[1] // k.shape[1]
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    k = k.repeat_interleave(group, dim=1).to(acc_dtype)
    v = v.repeat_interleave(group, dim=1).to(acc_dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.to(acc_dtype) @ k.transpose(-1, -2)) * scale
    if causal:
        Sq, Sk = q.shape[2], k.shape[2]
        mask = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(diagonal=Sk - Sq)
        s = s.masked_fill(~mask, float("-inf"))
    if window is not None:
        Sq, Sk = q.shape[2], k.shape[2]
        far = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(diagonal=Sk - Sq - window)
        s = s.masked_fill(far, float("-inf"))
    if docs is not None:
        s = s.masked_fill(~(docs[0].unsqueeze(-1) == docs[1].unsqueeze(-2)).unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no visible key: all -inf, no weight
    return (p @ v).to(q.dtype), lse


def sdpa_supports(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int | None = None, q_offset: int | None = None
) -> bool:
    """torch's fused CPU attention aligns a causal mask top-left (q_offset 0); ours is where q_offset says
    (bottom-right by default), so it serves causal calls only when that is 0. It computes fp32 and fp64 on
    CPU, with one head dim for q, k and v and no window."""
    offset = k.shape[2] - q.shape[2] if q_offset is None else q_offset
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and v.shape[-1] == q.shape[-1]
        and window is None
        and (not causal or offset == 0)
    )


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """(out, lse) from ATen's fused CPU flash attention; differentiable through `out` only."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # grouped-query heads: the fused op wants one kv head per query head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.to(torch.promote_types(q.dtype, torch.float32))


# ----------------------------------------------------------------------------- packed documents (varlen)
def document_ids(positions: Tensor, sequence_index: Tensor) -> Tensor | None:
    """Packed documents: each token's document, named by where it starts in the sequence (the token's index
    in the sequence minus its position), so ids are non-decreasing along a row and any shard of the row
    computes the same id for a token. None for positions (S,): one sequence, one document."""
    if positions.dim() == 1:
        return None
    return sequence_index.to(positions.device).view(1, -1) - positions


def document_segments(q_docs: Tensor, k_docs: Tensor) -> list[list[tuple[int, int, int, int, bool]]]:
    """Per batch row, its queries' document runs in order: (q_start, q_end, k_start, k_end, has_keys), the
    keys' run of the same document (ids non-decreasing along each row, so every document is one run)."""

    def runs_of(ids: Tensor) -> tuple[list[int], list[int]]:
        values, counts = torch.unique_consecutive(ids, return_counts=True)
        return values.tolist(), [0] + torch.cumsum(counts, 0).tolist()

    rows = []
    for b in range(q_docs.shape[0]):
        q_ids, q_bounds = runs_of(q_docs[b])
        k_ids, k_bounds = runs_of(k_docs[b])
        keys = {d: (k_bounds[i], k_bounds[i + 1]) for i, d in enumerate(k_ids)}
        runs = []
        for i, d in enumerate(q_ids):
            ks, ke = keys.get(d, (0, 0))
            runs.append((q_bounds[i], q_bounds[i + 1], ks, ke, ke > ks))
        rows.append(runs)
    return rows


def document_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_docs: Tensor,
    k_docs: Tensor,
    causal: bool = True,
    scale: float | None = None,
    grad_lse: bool = False,
    window: int | None = None,
    q_offset: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of document-masked attention computed one document at a time (varlen on CPU): each
    document's queries attend its keys through ATen's fused flash attention where it computes the same
    thing (else the blockwise reference, at the document's own q_offset), so the work is the sum of the
    documents' squares and no (S x S) mask exists. Differentiable in q, k, v through out (and lse when
    `grad_lse`, by the reference)."""
    B, Hq, Sq, D = q.shape
    Sk, Dv = k.shape[2], v.shape[3]
    offset = Sk - Sq if q_offset is None else q_offset
    runs = document_segments(q_docs, k_docs)
    acc = torch.promote_types(q.dtype, torch.float32)
    outs, lses = [], []
    for b, row in enumerate(runs):
        pieces, piece_lse = [], []
        for qs, qe, ks, ke, has_keys in row:
            if not has_keys:  # queries whose document has no key here: nothing visible
                pieces.append(q.new_zeros(1, Hq, qe - qs, Dv))
                piece_lse.append(torch.full((1, Hq, qe - qs), float("-inf"), dtype=acc, device=q.device))
                continue
            qb, kb, vb = q[b : b + 1, :, qs:qe], k[b : b + 1, :, ks:ke], v[b : b + 1, :, ks:ke]
            own = qs + offset - ks  # the document's query rows in its keys' positions
            if not grad_lse and sdpa_supports(qb, kb, vb, causal, window, own):
                o, lse = sdpa_attention(qb, kb, vb, causal, scale)
            else:
                o, lse = attention_reference(qb, kb, vb, causal, scale, window=window, q_offset=own)
            pieces.append(o)
            piece_lse.append(lse.to(acc))
        outs.append(torch.cat(pieces, dim=2))
        lses.append(torch.cat(piece_lse, dim=2))
    return torch.cat(outs), torch.cat(lses)


def document_attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    dlse: Tensor | None,
    q_docs: Tensor,
    k_docs: Tensor,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    q_offset: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """attention_backward_reference with document masks, one document at a time (ATen's fused backward
    where it applies)."""
    Sq, Sk = q.shape[2], k.shape[2]
    offset = Sk - Sq if q_offset is None else q_offset
    runs = document_segments(q_docs, k_docs)
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for b, row in enumerate(runs):
        for qs, qe, ks, ke, has_keys in row:
            if not has_keys:
                continue
            rows, cols = (slice(b, b + 1), slice(None), slice(qs, qe)), (slice(b, b + 1), slice(None), slice(ks, ke))
            qb, kb, vb = q[rows], k[cols], v[cols]
            own = qs + offset - ks
            if dlse is None and sdpa_supports(qb, kb, vb, causal, window, own):
                g = sdpa_attention_backward(do[rows], qb, kb, vb, o[rows], lse[rows], causal, scale)
            else:
                g = attention_backward_reference(
                    do[rows],
                    qb,
                    kb,
                    vb,
                    o[rows],
                    lse[rows],
                    None if dlse is None else dlse[rows],
                    causal,
                    scale,
                    window=window,
                    q_offset=own,
                )
            dq[rows] += g[0].to(acc)
            dk[cols] += g[1].to(acc)
            dv[cols] += g[2].to(acc)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------- attention sinks
def apply_sinks(o: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Attention sinks (gpt-oss): a learned logit s_h per query head in every softmax's denominator,
    o_i = sum_j e^(x_ij) v_j / (e^(s_h) + sum_j e^(x_ij)). Merged by log-sum-exp as a block whose value is 0
    and whose logit is s_h: lse' = logaddexp(lse, s_h), o' = o e^(lse - lse'). o (B, Hq, Sq, Dv), lse (B, Hq,
    Sq), sinks (Hq,); differentiable in all three. A row that sees no key (lse -inf) gives 0, not NaN.
    Apply it once to the whole softmax (after a ring's merge), never per block."""
    acc = torch.promote_types(lse.dtype, torch.float32)
    lse = lse.to(acc)
    new = torch.logaddexp(lse, sinks.to(acc).view(1, -1, 1))
    nothing = torch.isneginf(new)  # only when a sink is -inf too
    safe = torch.where(nothing, torch.zeros_like(new), new)
    keep = torch.where(nothing, torch.zeros_like(new), torch.exp(lse - safe))
    return (o.to(torch.promote_types(o.dtype, acc)) * keep.unsqueeze(-1)).to(o.dtype), new


class _SdpaWithSinks(torch.autograd.Function):
    """ATen's fused CPU attention with sinks, for calls that do not ask for the LSE (the model's): the
    generic route needs a differentiable LSE, which only the slower blockwise reference gives. A sink adds
    no value, so the gradient of q, k, v is the plain backward at the sunk softmax (o', lse'), and that of
    s_h is -sum_i e^(s_h - lse'_i) rowsum(dO'_i * O'_i)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, causal, scale):
        o, lse = sdpa_attention(q, k, v, causal, scale)
        o, lse = apply_sinks(o, lse, sinks)
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks = ctx.saved_tensors
        dq, dk, dv = sdpa_attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        delta = (do.to(lse.dtype) * o.to(lse.dtype)).sum(-1)
        dsinks = -(torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse) * delta).sum((0, 2))
        return dq, dk, dv, dsinks.to(sinks.dtype), None, None


def sdpa_attention_with_sinks(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, causal: bool = True, scale: float | None = None
) -> Tensor:
    """Out of attention with sinks by ATen's fused CPU op (the conditions of sdpa_supports); differentiable
    in q, k, v and sinks."""
    return _SdpaWithSinks.apply(q, k, v, sinks, causal, scale)

"""The HBM traffic of a context-parallel ring's merges: what a rank reads and writes, beside the attention
kernels and the K/V passes, to combine cp steps' partial outputs and accumulate their gradients. Counted from
each implementation's code, per layer and per cp-local token, in bytes; the step model (step_model.py) runs it
at the elementwise share of HBM bandwidth, eager (no ring's merges are fused by torch.compile).

Every implementation here balances causal work the same way: each rank holds a head and a tail chunk of the
sequence; step 0 attends its own keys causally over all its rows, and each later step either all its rows
against half the keys, or half its rows against all the keys. A later step's merge therefore covers 3/4 of
the rows on average over the ranks (`LATER_STEP_ROWS`). Notation: Q the query width a rank holds (its query
heads x head dim), W the K (or V) width its passes carry, e the compute dtype's bytes, a the accumulators'
(fp32, or the dtype when wider).

tessera   (parallel/context.py) forward: the fp32 output zeroed (a Q), then at every step merge_partial's
          out * keep (2a), the block's upcast (e + a), block * take (2a), their sum (3a) and the write back into
          the output's rows (2a): (10a + e) Q over the step's rows; the output's downcast (a + e) Q and the
          K/V packed once (2e x 2W). Backward: dq zeroed (a Q) and dK/dV's accumulator (a x 2W), K/V packed
          (2e x 2W), at every step dq's rows += the block's upcast (4a + e) Q and dk/dv's (4a + e) x 2W,
          and the three downcasts (a + e).
torch     (torch.distributed.tensor.experimental._attention's templated ring, the context parallel torchtitan
          runs) forward: the first block's output upcast (e + a) Q; at each later step the upcast
          (e + a) and _SDPAMerger's out - block, sigmoid(lse diff) x that, out - it (8a) over the step's rows,
          and on the half-row steps the whole output rebuilt by torch.cat (2a Q, half the steps); K and V
          concatenated into the next step's buffer at each step but the last (2e x 2W); the downcast
          (a + e) Q. Backward: dq, dk, dv zeroed in fp32; each step's block gradients added in fp32
          (2a + e; on half the steps into a half, then the whole rebuilt by torch.cat, 2a); dK/dV
          concatenated in fp32 for the ring at every step (2a x 2W) and K/V at every step but the last
          (2e x 2W); the downcasts.
fused     (Transformer Engine's context parallel, its out-correction and gradient-add kernels): one fp32
          read-modify-write of the output and of each gradient per step, (2a + e) over the step's rows, and
          the downcasts. An assumption drawn from the kernels' names and arguments (transformer_engine/common/
          fused_attn/context_parallel.cu), not from a count of every pass.
"""

from __future__ import annotations

RING_MERGES = ("tessera", "torch", "fused")
LATER_STEP_ROWS = 0.75  # a later step's share of the rows (or keys) it touches, over the ranks


def ring_merge_bytes(merge: str, cp: int, q_width: int, kv_width: int, dtype_bytes: int = 2) -> tuple[float, float]:
    """(forward, backward) bytes one rank's ring merges read and write per layer and per cp-local token (module
    doc); (0, 0) without context parallelism. `kv_width`: one of K or V, as the passes carry it."""
    if merge not in RING_MERGES:
        raise ValueError(f"cp_merge={merge!r}: use one of {', '.join(RING_MERGES)}")
    if cp == 1:
        return 0.0, 0.0
    e, a = dtype_bytes, max(4, dtype_bytes)
    q, kv = float(q_width), 2.0 * kv_width
    later = cp - 1
    steps = 1 + LATER_STEP_ROWS * later  # every step's rows, the first whole
    downcast = a + e
    if merge == "tessera":
        forward = q * (a + (10 * a + e) * steps + downcast) + kv * 2 * e
        backward = q * (a + (4 * a + e) * steps + downcast) + kv * (a + 2 * e + (4 * a + e) * steps + downcast)
    elif merge == "torch":
        rebuilt = 2 * a * 0.5  # the torch.cat of the whole buffer, on half the later steps
        forward = q * ((e + a) + later * (LATER_STEP_ROWS * (e + 9 * a) + rebuilt) + downcast) + kv * later * 2 * e
        add = 2 * a + e
        backward = q * (a + add + later * (LATER_STEP_ROWS * add + rebuilt) + downcast) + kv * (
            a + add + later * (LATER_STEP_ROWS * add + rebuilt + 2 * e) + cp * 2 * a + downcast
        )
    else:
        correct = (2 * a + e) * steps
        forward = q * (correct + downcast)
        backward = (q + kv) * (correct + downcast)
    return forward, backward

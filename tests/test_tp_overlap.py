"""What another framework's tensor parallel moves and hides, as the planner models it for predicting its runs
(topology/estimators/step_model.py, comm_model.py): under async TP each of a block's four collectives hides
behind its own matmuls, not the step's pooled; torchao's float8 tp styles (torchtitan's tensorwise FP8) gather
the activations in FP8."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.topology import Layout
from tessera.topology.estimators.comm_model import comm_bytes_per_step
from tessera.topology.estimators.step_model import TP_NEIGHBOURS, exposed_comm
from tessera.topology.shapes import ModelShape

SHAPE = ModelShape(dim=512, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=64, vocab_size=1024, ffn_dim=1536)


@settings(max_examples=50, deadline=None)
@given(
    tp=st.sampled_from([2, 4, 8]),
    comm=st.floats(1e-3, 1.0),
    matmuls=st.lists(st.floats(0.0, 0.2), min_size=4, max_size=4),
    blocks=st.integers(1, 6),
    microbatches=st.integers(1, 4),
)
def test_each_async_collective_hides_behind_its_own_matmuls_only(tp, comm, matmuls, blocks, microbatches):
    count = (blocks * 8 + 2) * microbatches  # collective_counts' tp count: 8 a block, the head's 2
    parts = {"compute": 10.0, "optimizer": 0.0, "matmul": 5.0, "attention": 1.0, **dict(zip(TP_NEIGHBOURS, matmuls))}
    common = dict(tp=tp, pp=1, microbatches=microbatches, units=blocks + 2, tp_collectives=count)
    exposed = exposed_comm({"tp": comm}, parts, async_tp=True, **common)["tp"]
    per = comm / count
    want = 2 * microbatches * per + sum(
        blocks * 2 * microbatches * (per / tp + max(0.0, per * (tp - 1) / tp - m)) for m in matmuls
    )
    assert exposed == pytest.approx(want)
    # never more than the collectives without async TP, never less than their first chunks and the head's
    assert comm / tp - 1e-12 <= exposed <= exposed_comm({"tp": comm}, parts, async_tp=False, **common)["tp"] + 1e-12


@pytest.mark.parametrize("ac", ["none", "full"])
def test_fp8_tp_gathers_move_one_byte_an_element(ac):
    """torchao's Float8ColwiseParallel casts a block's input to FP8 before the all-gather, and the backward gathers
    the row-parallel output gradient in FP8: half of the eight passes a block (and two of a recompute's three)
    at 1 byte instead of 2; the reduce-scatters stay in the compute dtype."""
    lay = Layout(dp_shard=2, tp=4)
    common = dict(microbatches=2, sequence_parallel=True, ac=ac, act_bytes=2, param_bytes=2, reduce_bytes=4)
    plain = comm_bytes_per_step(SHAPE, lay, 256, 8, **common)["tp"]
    same = comm_bytes_per_step(SHAPE, lay, 256, 8, tp_gather_bytes=2, **common)["tp"]
    fp8 = comm_bytes_per_step(SHAPE, lay, 256, 8, tp_gather_bytes=1, **common)["tp"]
    assert same == plain
    rows, tokens = 8 // 2 // 2, 256
    gather_2, gather_1 = (rows * tokens * SHAPE.dim * e * (4 - 1) / 4 for e in (2, 1))  # a gather's wire bytes
    gathers = SHAPE.n_layers * (4 + (2 if ac == "full" else 0)) * 2  # a block's, its recompute's; 2 microbatches
    assert plain - fp8 == pytest.approx(gathers * (gather_2 - gather_1))

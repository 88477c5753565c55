"""What a compiled block keeps for backward (topology/estimators/activations.py's compiled_block_bytes): the
outputs of its matmuls and attention core and its input, per block kind. For Llama's block it is the op
policy's count the planner already used for compiled blocks (to the byte); for every family and block kind it
keeps less than the same block eager and more than a fully checkpointed one; and it is what lets a compiled
(or Transformer Engine-fused) MoE job whose blocks differ fit where its authors ran it."""

import json
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.commands.plan import model_shape
from tessera.topology.estimators.activations import block_activation_bytes, compiled_block_bytes, uses_block_model
from tessera.topology.estimators.rank_memory import layer_activation_bytes

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("8b", "qwen3-8b", "qwen3-30b-a3b", "deepseek-v3-lite", "deepseek-v3-671b", "gpt-oss-20b", "gpt-oss-120b")


@settings(max_examples=80, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), sp=st.booleans(), rows=st.integers(1, 4), seq=st.sampled_from([128, 4096]))
def test_a_compiled_llama_block_keeps_what_the_op_policy_keeps(tp, sp, rows, seq):
    shape = model_shape("8b")
    assert not uses_block_model(shape)
    op = layer_activation_bytes(shape, rows, seq, tp, sp, "op", 2, cpu=False)
    assert compiled_block_bytes(shape, 0, rows, seq, tp, sp, 2) == op


@settings(max_examples=120, deadline=None)
@given(
    model=st.sampled_from(FAMILIES),
    layer=st.integers(0, 5),
    tp=st.sampled_from([1, 2, 4]),
    sp=st.booleans(),
    seq=st.sampled_from([256, 4096]),
)
def test_a_compiled_block_keeps_less_than_eager_and_more_than_full_checkpointing(model, layer, tp, sp, seq):
    shape = model_shape(model)
    compiled = compiled_block_bytes(shape, layer, 1, seq, tp, sp, 2)
    eager = block_activation_bytes(shape, layer, 1, seq, tp, sp, 2, False)
    full = layer_activation_bytes(shape, 1, seq, tp, sp, "full", 2)
    assert full < compiled < eager
    # linear in the rows: nothing is counted once per block regardless of the batch
    assert compiled_block_bytes(shape, layer, 3, seq, tp, sp, 2) == 3 * compiled


def test_gpt_oss_120b_fits_on_the_h100s_megatron_bridge_ran_it_on():
    """Megatron-Bridge's gpt-oss-120b row (pp4 x ep8 on 64 H100 80 GB, no recompute beyond layernorm and the
    MoE activation, Transformer Engine's fused blocks): counted as eager blocks it needed 91.5 GiB, over the
    card; counted as compiled blocks its activations are what the fused kernels keep."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_published  # the published rows' own scoring

    runs = json.loads((ROOT / "benchmarks/published/runs.json").read_text())
    row = next(r for r in runs["rows"] if r["id"] == "mb-gpt-oss-120b-64")
    x, hw = bench_published.authors_estimate(row, runs["sources"][row["source"]], 0.5)
    assert x.fits, {k: round(v / 2**30, 2) for k, v in x.memory.items()}
    assert x.memory["activations"] < 0.5 * x.memory["total"]

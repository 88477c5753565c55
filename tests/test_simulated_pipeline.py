"""The pipeline in a simulated world (parallel/pipeline_simulated.py): a thread per pp rank, each under a
LocalTensorMode over its stage's ranks, one running at a time; the executor's messages posted and taken in
this process, all-reduces across stages reduced over their groups, any other collective across stages refused.
Each proof runs in a fresh interpreter: a simulated world needs a process with no process group of its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torch
from tessera.topology import Layout

pytest.importorskip("torch.distributed._local_tensor", reason="a simulated world needs torch's LocalTensorMode")
pytestmark = pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13), reason="simulated worlds checked on torch 2.13"
)

# several proofs in one interpreter (a simulated run leaves no process group behind): each [layout, options]
PROOFS = """
import json, sys
{plant}
from tessera.testing import LayoutsDiverge, prove_layout
def proved(layout, options):
    try:
        record = prove_layout(layout, **options)
        return {{"equal": True, "verdict": record["verdict"], "layers": record["shape"]["n_layers"],
                 "norms": [record["grad_norms"], record["one_process_grad_norms"]]}}
    except LayoutsDiverge as e:
        return {{"equal": False, "verdict": str(e)}}
print(json.dumps([proved(layout, options) for layout, options in json.loads(sys.argv[1])]))
"""


def prove(runs: list[tuple[str, dict]], plant: str = "") -> list[dict]:
    child = PROOFS.format(plant=plant)
    out = subprocess.run([sys.executable, "-c", child, json.dumps(runs)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_equal(record: dict, layout: str) -> None:
    assert record["equal"] and record["verdict"].startswith(f"equal to one process: {layout} on "), record
    for a, b in zip(*record["norms"]):
        assert abs(a - b) <= 1e-5 * abs(b), record


@pytest.mark.slow
def test_a_pipeline_with_fsdp2_and_tied_weights_across_its_stages_equals_one_process():
    """pp 2 x dp 2 on the debug model and on qwen3-debug, whose head is tied to its embedding: the tied
    gradient's all-reduce over the first and last stage crosses the stages' simulated worlds."""
    debug, tied = prove([("pp2xdp2", {}), ("pp2xdp2", {"model": "qwen3-debug"})])
    assert_equal(debug, "pp2xdp2")
    assert_equal(tied, "pp2xdp2")


@pytest.mark.slow
def test_every_schedule_in_a_simulated_pipeline_equals_one_process():
    """Every kind of tessera train's --schedule on pp 2 x dp 2 (zero-bubble kinds run W apart from B; zbv and
    dualpipev two stages per rank on a V, where the model gets the 4 layers they need)."""
    kinds = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "looped-bfs", "interleaved-zb", "zbv", "dualpipev"]
    virtual = {k: {"virtual": 2} for k in kinds if k.startswith(("interleaved", "looped"))}
    records = prove([("pp2xdp2", {"schedule": k, **virtual.get(k, {})}) for k in kinds])
    for kind, record in zip(kinds, records):
        assert_equal(record, "pp2xdp2")
        assert record["layers"] == (4 if kind not in ("gpipe", "1f1b", "zb-h1") else 2), (kind, record)


@pytest.mark.slow
def test_a_pipeline_composed_with_every_other_axis_equals_one_process():
    """pp inside tp with sequence parallel, the cp ring, expert parallel and HSDP, and pp 4 on 32 ranks."""
    layouts = ["pp2xdp2xtp2+sp", "pp2xcp2xdp2", "pp2xdp2xep2", "pp2xdpr2xdp2", "pp4xdp4xtp2+sp"]
    for layout, record in zip(layouts, prove([(layout, {}) for layout in layouts])):
        assert_equal(record, layout)


@pytest.mark.slow
def test_a_planted_pipeline_bug_passes_at_pp4_and_is_caught_by_name_at_pp8():
    """A microbatch index kept in 2 bits: from the fifth microbatch on, the executor trains microbatch (m mod 4)'s
    rows again. pp 4 (1f1b on its 4 microbatches) never shows it; pp 8 (8 microbatches) is named by the first
    gradient it moves."""
    plant = (
        "from tessera.parallel.pipeline import PipelineRunner\n"
        "real = PipelineRunner.forward_backward\n"
        "def wrapped(self, microbatches, valid):\n"
        "    return real(self, [microbatches[m % 4] for m in range(len(microbatches))], valid)\n"
        "PipelineRunner.forward_backward = wrapped\n"
    )
    small, large = prove([("pp4", {}), ("pp8", {})], plant)
    assert_equal(small, "pp4")
    assert not large["equal"] and "pp8 on 8 simulated ranks, step 1: gradient of parameter" in large["verdict"], large


# ----------------------------------------------------------------------------- the coordinator itself
CROSSING = """
import json
import torch, torch.distributed as dist
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from tessera.parallel.pipeline_simulated import (SimulatedPipeline, StageCrossing, modes_per_thread,
                                                 stage_crossing_collectives)
from tessera.topology import Layout
layout = Layout(pp=2, dp_shard=2)
dist.init_process_group("fake", rank=0, world_size=4)
mesh = layout.build_mesh("cpu")
stages = [[0, 1], [2, 3]]
pipeline = SimulatedPipeline(stages)
def stage(p):
    with LocalTensorMode(frozenset(stages[p])) as mode:
        x = mode.rank_map(lambda r: torch.tensor([float(r + 1)]))
        dist.all_reduce(x, group=mesh["pp"].get_group())  # rank r with r + 2 (or r - 2): every pipeline's sum
        y = mode.rank_map(lambda r: torch.tensor([float(r + 1)]))
        dist.all_reduce(y, group=mesh["dp_shard"].get_group())  # within the stage: its own world
        sent = mode.rank_map(lambda r: torch.tensor([10.0 * r]))
        if p == 0:
            pipeline.post(0, 1, ("act", 0, 1), sent)
            got = None
        else:
            got = pipeline.take(1, ("act", 0, 1))
        try:
            dist.broadcast(x, src=0, group=mesh["pp"].get_group())
            refused = ""
        except StageCrossing as e:
            refused = str(e)
        with mode.disable():
            return {"x": {r: x._local_tensors[r].item() for r in stages[p]},
                    "y": {r: y._local_tensors[r].item() for r in stages[p]},
                    "got": None if got is None else {r: got._local_tensors[r].item() for r in stages[p]},
                    "refused": refused}
with modes_per_thread(), stage_crossing_collectives():
    out = pipeline.run(stage)
stalled = SimulatedPipeline([[0], [1]])
try:
    stalled.run(lambda p: stalled.take(p, ("grad", 3, p)))
    stall = ""
except RuntimeError as e:
    stall = str(e)
print(json.dumps({"stages": out, "stall": stall}))
"""


def test_collectives_across_simulated_stages_are_reduced_over_their_groups_or_refused_by_name():
    """Against sums written out by hand: an all-reduce over pp sums each pipeline's ranks (1 + 3, 2 + 4), one
    over dp stays within a stage (1 + 2, 3 + 4); a message moves each rank's value to the rank of the same data
    coordinates on the next stage; a broadcast across stages is refused (torch's simulated collectives would
    skip a group the stage's world does not hold); two stages waiting on each other are named as a stall."""
    out = subprocess.run([sys.executable, "-c", CROSSING], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    first, second = result["stages"]
    assert first["x"] == {"0": 4.0, "1": 6.0} and second["x"] == {"2": 4.0, "3": 6.0}
    assert first["y"] == {"0": 3.0, "1": 3.0} and second["y"] == {"2": 7.0, "3": 7.0}
    assert second["got"] == {"2": 0.0, "3": 10.0}
    for stage in (first, second):
        assert "spans pipeline stages; the simulated pipeline runs only all-reduces across stages" in stage["refused"]
    assert result["stall"] == (
        "the simulated pipeline stalled, every stage waiting: pp rank 0 waits for grad of microbatch 3 for stage 0; "
        "pp rank 1 waits for grad of microbatch 3 for stage 1"
    )


@given(n_layers=st.integers(1, 40), pp=st.sampled_from([1, 2, 4, 8, 16]), virtual=st.integers(1, 5))
@settings(max_examples=80, deadline=None)
def test_pipeline_layers_is_the_fewest_that_every_stage_splits_evenly(n_layers, pp, virtual):
    from tessera.training.simulated import pipeline_layers

    got, stages = pipeline_layers(n_layers, pp, virtual), pp * virtual
    assert got % stages == 0 and got >= max(n_layers, stages) and got - n_layers < stages
    assert (got == n_layers) == (n_layers % stages == 0)


def test_a_pipeline_option_without_a_pp_layout_is_refused_before_anything_is_built():
    from tessera.testing import prove_layout

    with pytest.raises(ValueError, match="schedule=zbv with layout=dp2: a pipeline option needs a pp layout"):
        prove_layout("dp2", schedule="zbv")


big_degree = st.sampled_from([1, 2, 4, 8])


@given(
    st.builds(
        Layout,
        pp=st.sampled_from([2, 4, 8, 16]),
        dp_replicate=big_degree,
        dp_shard=big_degree,
        cp=big_degree,
        tp=big_degree,
    ).filter(lambda layout: layout.world_size <= 4096)
)
@settings(max_examples=60, deadline=None)
def test_the_stages_ranks_are_aligned_by_every_other_coordinate_at_production_sizes(layout):
    """stage_ranks (pure): pp rank p's ranks are exactly those with pp coordinate p, and entry i of every stage
    differs from entry i of the first only in pp (a message moves each rank's value to its own pipeline's
    next stage), up to 4,096 ranks."""
    from tessera.parallel.pipeline_simulated import stage_ranks

    stages = stage_ranks(layout)
    assert len(stages) == layout.pp and sorted(r for s in stages for r in s) == list(range(layout.world_size))
    for p, ranks in enumerate(stages):
        assert {layout.coords(r)["pp"] for r in ranks} == {p}
        for i in range(0, len(ranks), max(1, len(ranks) // 16)):  # a spread of them: the check is O(world)
            want = {**layout.coords(stages[0][i]), "pp": p}
            assert layout.coords(ranks[i]) == want


@pytest.mark.slow
def test_muon_in_a_simulated_world_equals_one_process_and_a_shard_orthogonalized_alone_is_caught():
    """--optimizer muon: each sharded matrix gathered whole to its owner, whose gather every simulated rank
    receives (an all-gather) and whose scatter each rank reads its own part of; over tp + SP, inside a
    pipeline's stages, and over experts. The planted bug of tests/test_muon_contract.py (each rank
    orthogonalizing its own shard) is named at step 2, the first step Muon moved the weights."""
    runs = [
        ("dp2xtp2+sp", {"optimizer": "muon"}),
        ("pp2xdp2", {"optimizer": "muon"}),
        ("dp4xep2", {"optimizer": "muon"}),
    ]
    for (layout, _), record in zip(runs, prove(runs)):
        assert_equal(record, layout)
        assert "with Muon" in record["verdict"]
    (planted,) = prove(
        [("dp2xtp2+sp", {"optimizer": "muon"})], "import tessera.parallel.muon as m\nm.SHARD_ALONE = True\n"
    )
    assert not planted["equal"] and "with Muon, step 2: loss" in planted["verdict"], planted

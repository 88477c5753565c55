"""The layout planner (topology/planner.py) and `tessera plan`: exact parameter counts against the fake-backend
build, the reference chapter's figures, the constraints every ranked layout keeps, and the CLI's answers."""

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.models import get_preset
from tessera.topology import Layout
from tessera.topology.memory import GB, min_gpus, model_state_bytes
from tessera.topology.planner import (
    Candidate,
    Hardware,
    PlanError,
    estimate,
    plan,
    rank_params,
    rank_params_of,
    why_best,
)
from tessera.topology.shapes import fsdp_shard_numel


def _tessera(*args):
    return subprocess.run([sys.executable, "-m", "tessera", *args], capture_output=True, text=True, timeout=300)


def test_the_reference_chapter_figures():
    assert round(model_state_bytes(70e9, dp=256, zero_stage=3)["total"] / GB, 2) == 4.38
    assert min_gpus(70e9, 80) == 14
    # the planner's model states for 70B on dp_shard 256 are the same recipe, on the preset's exact count
    cfg = get_preset("70b")
    est = estimate(cfg, Candidate(Layout(dp_shard=256), ac="full"), Hardware(gpus=256), 4096, 256)
    states = est.memory["parameters"] + est.memory["gradients"] + est.memory["optimizer"]
    assert states == pytest.approx(model_state_bytes(cfg.num_params(), dp=256, zero_stage=3)["total"], rel=2e-3)
    assert round(states / GB, 2) == round(4.38 * cfg.num_params() / 70e9, 2)


@pytest.mark.parametrize("model, layout, virtual", [
    ("8b", Layout(pp=2, dp_shard=4, tp=2), 1),
    ("70b", Layout(pp=4, dp_shard=8, cp=2, tp=8), 2),
    ("8b", Layout(dp_shard=3, tp=16), 1),  # tp beyond the 8 kv heads: K/V replicated; 3 shards cut unevenly
    ("debug", Layout(dp_replicate=2, dp_shard=5, tp=4), 1),
    ("405b", Layout(pp=8, dp_shard=64, tp=8), 1),
], ids=str)
def test_planner_counts_parameters_exactly_as_the_dry_run_builds_them(model, layout, virtual):
    from tessera.parallel.parallelize import dry_run_model_states
    from tessera.parallel.pipeline import PipelineConfig

    cfg = get_preset(model)
    fsdp = layout.dp_shard * layout.cp
    tp_local, sharded, _ = rank_params(cfg, layout.tp, layout.pp, virtual, fsdp)
    counted = [dry_run_model_states(model, layout, rank=layout.rank_of({"pp": p}), pipeline=PipelineConfig(virtual=virtual))
               for p in sorted({0, layout.pp - 1})]
    most = max(counted, key=lambda m: m["tp_local_params"])
    assert tp_local == most["tp_local_params"] and sharded == most["local_params"]


@pytest.mark.parametrize("model", ["1b", "8b", "70b", "405b"])
def test_every_preset_builds_on_a_4d_layout_holding_only_its_share(model):
    """Meta build on the fake backend, all five axes: a rank holds its pp stage's tp slice's FSDP shard."""
    from tessera.parallel.parallelize import dry_run_model_states

    cfg = get_preset(model)
    layout = Layout(pp=4, dp_replicate=2, dp_shard=4, cp=2, tp=8)
    for pp_rank in range(layout.pp):
        m = dry_run_model_states(model, layout, rank=layout.rank_of({"pp": pp_rank}))
        assert m["local_params"] == rank_params_of(cfg, 8, 4, 1, 8, pp_rank)[1]
        assert m["local_params"] < 2 * cfg.num_params() / (4 * 8 * 8)  # about 1/(pp x tp x dp_shard x cp) of the model


def test_the_dry_runs_fsdp_count_is_fully_shards(tmp_path):
    """The dry run counts FSDP2's shards by the torch.chunk rule instead of calling fully_shard (seconds
    instead of minutes at 4096 ranks); on layouts small enough, fully_shard itself agrees on every rank."""
    import torch.multiprocessing  # noqa: F401
    from torch.distributed.tensor import DTensor

    from tessera.models import build_model
    from tessera.parallel.data import DataParallelConfig, apply_fsdp
    from tessera.parallel.parallelize import dry_run_model_states
    from tessera.parallel.tensor import apply_tp
    from tessera.topology import Meshes, dry_run

    for layout in (Layout(dp_shard=3, tp=2), Layout(dp_replicate=2, dp_shard=2, cp=2, tp=4)):
        for rank in range(0, layout.world_size, 3):
            counted = dry_run_model_states("debug", layout, rank=rank)["local_params"]
            with dry_run(layout, rank=rank) as mesh:
                meshes = Meshes(layout, "cpu", mesh=mesh)
                model = build_model(get_preset("debug"), device="meta")
                apply_tp(model, meshes.tp)
                apply_fsdp(model, meshes.fsdp, DataParallelConfig())
                real = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
            assert counted == real, (layout, rank)


@given(st.integers(1, 300), st.integers(1, 9), st.integers(0, 6))
def test_fsdp_shards_partition_the_rows(rows, cols, log_shards):
    shards = 2 ** log_shards
    sizes = [fsdp_shard_numel(rows, cols, shards, i) for i in range(shards)]
    assert sum(sizes) == rows * cols and max(sizes) == fsdp_shard_numel(rows, cols, shards, 0)


@settings(max_examples=25, deadline=None)
@given(model=st.sampled_from(["debug", "small", "1b", "8b"]), nodes=st.sampled_from([1, 2, 4]),
       per_node=st.sampled_from([2, 4, 8]), seq_exp=st.integers(8, 13), batch_mult=st.sampled_from([1, 2, 4]),
       memory=st.sampled_from([16.0, 40.0, 80.0]))
def test_every_ranked_layout_is_runnable_and_fits(model, nodes, per_node, seq_exp, batch_mult, memory):
    hw = Hardware(gpus=nodes * per_node, gpu_memory_gb=memory, gpus_per_node=per_node)
    try:
        result = plan(model, hw, 2 ** seq_exp, hw.gpus * batch_mult)
    except PlanError as e:
        assert "short by" in str(e) and "closest" in str(e)
        return
    from tessera.parallel.data import DataParallelConfig
    from tessera.parallel.parallelize import ParallelConfig
    from tessera.parallel.pipeline import PipelineConfig

    cfg = get_preset(model)
    times = [x.time["step"] for x in result.ranked]
    assert times == sorted(times) or all(abs(a - b) < 1e-6 for a, b in zip(times, sorted(times)))
    for x in result.ranked:
        c, lay = x.candidate, x.candidate.layout
        assert lay.world_size == hw.gpus and lay.tp <= per_node
        assert x.memory["total"] <= hw.usable_bytes
        parts = {k: v for k, v in x.memory.items() if k != "total"}
        # the peak: the start of backward or the optimizer step, whichever holds more
        assert parts["parameters"] + parts["optimizer"] + parts["activations"] <= x.memory["total"]
        assert x.memory["total"] <= sum(parts.values()) + parts["gradients"]  # the optimizer step: grads + temporaries
        assert 0 <= x.bubble < 1 and (x.bubble == 0) == (lay.pp == 1)
        ParallelConfig(lay, c.sequence_parallel, DataParallelConfig(c.strategy, "bf16", c.ac),
                       PipelineConfig(schedule=c.schedule, microbatches=c.microbatches, virtual=c.virtual)).check(
            cfg, 2 ** seq_exp, hw.gpus * batch_mult, c.microbatches)
    assert why_best(result)


def test_memory_model_directions():
    """Checkpointing saves memory and costs time; SHARD_GRAD_OP holds the gathered stage; tp beyond the kv
    heads holds the whole K/V weights (the planner counts them, an even 1/tp split would not)."""
    cfg, hw = get_preset("8b"), Hardware(gpus=16)
    base = Candidate(Layout(dp_shard=2, tp=8), microbatches=1)
    none, full = (estimate(cfg, Candidate(base.layout, ac=ac), hw, 4096, 16) for ac in ("none", "full"))
    assert full.memory["activations"] < none.memory["activations"] / 5 and full.time["compute"] > none.time["compute"]
    zero2 = estimate(cfg, Candidate(base.layout, strategy="SHARD_GRAD_OP"), hw, 4096, 16)
    assert zero2.memory["gathered_params"] > 5 * none.memory["gathered_params"]
    tp16 = rank_params(cfg, 16, 1, 1, 1)[0]
    even = cfg.num_params() / 16
    kv = 2 * cfg.n_layers * cfg.dim * cfg.n_kv_heads * cfg.head_dim  # K and V weights of every layer
    assert tp16 == pytest.approx(even - kv / 16 + kv, rel=0.01)


def test_plan_cli_ranks_layouts_and_dry_runs_the_best():
    out = _tessera("plan", "--model", "405b", "--gpus", "4096", "--seq-len", "8192", "--global-batch", "1024",
                   "--top", "3", "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("405b on 4096 GPUs of 80 GB") and len([ln for ln in lines[2:] if ln[:3].strip().isdigit()]) == 3
    assert any(ln.startswith("best: tessera train --") for ln in lines) and any(ln.startswith("why: it") for ln in lines)
    counted = next(ln for ln in lines if ln.startswith("model states of the rank holding the most"))
    numbers = [float(w) for w in counted.replace(",", " ").split() if w.replace(".", "").isdigit()]
    assert numbers[0] == pytest.approx(numbers[1], rel=1e-3)  # the estimate's states are the exact count


def test_plan_cli_json():
    out = _tessera("plan", "--model", "8b", "--gpus", "16", "--seq-len", "4096", "--global-batch", "32", "--json", "--top", "4")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["ranked"]) == 4 and data["request"]["hardware"]["gpus"] == 16
    top = data["ranked"][0]
    assert set(top["memory_bytes"]) >= {"parameters", "activations", "total"} and top["time_s"]["step"] > 0
    assert top["flags"].startswith("--") and 0 < top["mfu"] < 1


@pytest.mark.parametrize("args, message", [
    (["--model", "70b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "8"],
     r"70b does not fit on 8 GPUs of 80 GB .* needs \d+\.\d GB per rank against 72\.0 GB usable .* short by"),
    (["--model", "8b", "--gpus", "12", "--gpus-per-node", "8", "--seq-len", "4096", "--global-batch", "12"],
     r"--gpus 12 is not a whole number of nodes of 8"),
    (["--model", "nope", "--gpus", "8", "--seq-len", "4096", "--global-batch", "8"], r"unknown model preset 'nope'"),
    (["--model", "debug", "--gpus", "64", "--seq-len", "30", "--global-batch", "3"], r"no layout of 64 GPUs runs debug"),
])
def test_plan_cli_refuses_with_one_line(args, message):
    import re

    out = _tessera("plan", *args)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and re.search(message, out.stderr), out.stderr

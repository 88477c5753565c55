"""The layout planner (topology/estimators/) and `tessera plan`: exact parameter counts against the fake-backend
build, the reference chapter's figures, the constraints every ranked layout keeps, the CLI's answers, and
the model shapes (topology/shapes.py) it counts with: every family's tensors, FLOPs, torch-free validity."""

import functools
import json
import re
import subprocess
import sys

import pytest

from helpers import cli_here
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.models import get_preset
from tessera.commands.plan import model_shape
from tessera.topology import Layout
from tessera.topology.estimators.comm_model import stage_layer_counts
from tessera.topology.memory import GB, min_gpus, model_state_bytes
from tessera.topology.estimators.planner import (
    AC_MODES,
    STRATEGIES,
    Candidate,
    Hardware,
    PlanError,
    candidates,
    estimate,
    plan,
    why_best,
    why_not_runnable,
    wins_by,
)
from tessera.topology.estimators.plan_inputs import SCHEDULES
from tessera.topology.estimators.step_estimate import model_flops_per_token
from tessera.topology.estimators.rank_memory import rank_params, rank_params_of
from tessera.topology.shapes import ModelShape, as_shape, fsdp_shard_numel, layer_param_shapes, stage_param_shapes


def _tessera(*args):
    return cli_here(*args)


def test_the_reference_chapter_figures():
    assert round(model_state_bytes(70e9, dp=256, zero_stage=3)["total"] / GB, 2) == 4.38
    assert min_gpus(70e9, 80) == 14
    # the planner's model states for 70B on dp_shard 256 are the same recipe, on the preset's exact count
    cfg = model_shape("70b")
    est = estimate(cfg, Candidate(Layout(dp_shard=256), ac="full"), Hardware(gpus=256), 4096, 256)
    states = est.memory["parameters"] + est.memory["gradients"] + est.memory["optimizer"]
    assert states == pytest.approx(model_state_bytes(cfg.num_params(), dp=256, zero_stage=3)["total"], rel=2e-3)
    assert round(states / GB, 2) == round(4.38 * cfg.num_params() / 70e9, 2)


@pytest.mark.parametrize(
    "model, layout, virtual",
    [
        ("8b", Layout(pp=2, dp_shard=4, tp=2), 1),
        ("70b", Layout(pp=4, dp_shard=8, cp=2, tp=8), 2),
        ("8b", Layout(dp_shard=3, tp=16), 1),  # tp beyond the 8 kv heads: K/V replicated; 3 shards cut unevenly
        ("debug", Layout(dp_replicate=2, dp_shard=5, tp=4), 1),
        ("405b", Layout(pp=8, dp_shard=64, tp=8), 1),
        # Qwen3: head_dim 128 != dim / heads, qk-norm weights, a tied head whose last pipeline stage holds a copy
        ("qwen3-0.6b", Layout(pp=2, dp_shard=4, tp=2), 1),
        ("qwen3-debug", Layout(dp_shard=3, tp=4), 1),  # tp beyond its 2 kv heads, tied, one stage
        ("qwen3-8b", Layout(pp=2, dp_shard=2, cp=2, tp=8), 2),  # untied
        # Qwen3-MoE: the experts split over ep (E / ep each), FSDP-sharded over the dp_shard x cp / ep ranks left
        ("qwen3-moe-debug", Layout(dp_shard=8, ep=4), 1),
        ("qwen3-moe-debug", Layout(pp=2, dp_shard=4, tp=2, ep=2), 1),
        ("qwen3-moe-debug", Layout(dp_shard=2, cp=2, ep=4), 1),
        ("qwen3-moe-debug", Layout(dp_shard=3, tp=2), 1),  # experts without ep: cut on their expert dim over 3
        ("qwen3-moe-shared-debug", Layout(pp=2, dp_shard=4, tp=2, ep=4), 1),  # a shared expert split like an MLP
        ("qwen3-30b-a3b", Layout(dp_shard=8, ep=4), 1),
        ("qwen3-30b-a3b", Layout(pp=2, dp_shard=4, tp=2, ep=2), 1),
        ("qwen3-30b-a3b", Layout(dp_replicate=2, dp_shard=2, cp=2, tp=4, ep=4), 1),
        ("qwen3-30b-a3b", Layout(pp=4, dp_shard=6, cp=2, ep=4), 2),  # 3 edp ranks cut 32 experts unevenly
    ],
    ids=str,
)
def test_planner_counts_parameters_exactly_as_the_dry_run_builds_them(model, layout, virtual):
    from tessera.parallel.parallelize import dry_run_model_states
    from tessera.parallel.pipeline import PipelineConfig

    shape = model_shape(model)
    fsdp = layout.dp_shard * layout.cp
    tp_local, sharded, _ = rank_params(shape, layout.tp, layout.pp, virtual, fsdp, layout.ep)
    counted = [
        dry_run_model_states(model, layout, rank=layout.rank_of({"pp": p}), pipeline=PipelineConfig(virtual=virtual))
        for p in sorted({0, layout.pp - 1})
    ]
    most = max(counted, key=lambda m: m["tp_local_params"])
    assert tp_local == most["tp_local_params"] and sharded == most["local_params"]


@pytest.mark.parametrize("model", ["1b", "8b", "70b", "405b"])
def test_every_preset_builds_on_a_4d_layout_holding_only_its_share(model):
    """Meta build on the fake backend, all five axes: a rank holds its pp stage's tp slice's FSDP shard."""
    from tessera.parallel.parallelize import dry_run_model_states

    cfg = model_shape(model)
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
    from tessera.parallel.fsdp import DataParallelConfig, apply_fsdp
    from tessera.parallel.parallelize import dry_run_model_states
    from tessera.parallel.tp_plan import apply_tp
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
    shards = 2**log_shards
    sizes = [fsdp_shard_numel(rows, cols, shards, i) for i in range(shards)]
    assert sum(sizes) == rows * cols and max(sizes) == fsdp_shard_numel(rows, cols, shards, 0)


@settings(max_examples=25, deadline=None)
@given(
    model=st.sampled_from(["debug", "small", "1b", "8b", "qwen3-0.6b", "qwen3-moe-debug"]),
    nodes=st.sampled_from([1, 2, 4]),
    per_node=st.sampled_from([2, 4, 8]),
    seq_exp=st.integers(8, 13),
    batch_mult=st.sampled_from([1, 2, 4]),
    memory=st.sampled_from([16.0, 40.0, 80.0]),
)
def test_every_ranked_layout_is_runnable_and_fits(model, nodes, per_node, seq_exp, batch_mult, memory):
    hw = Hardware(gpus=nodes * per_node, gpu_memory_gb=memory, gpus_per_node=per_node)
    try:
        result = plan(model_shape(model), hw, 2**seq_exp, hw.gpus * batch_mult, name=model)
    except PlanError as e:
        assert "short by" in str(e) and "closest" in str(e)
        return
    from tessera.parallel.fsdp import DataParallelConfig
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
        ParallelConfig(
            lay,
            c.sequence_parallel,
            DataParallelConfig(c.strategy, "bf16", c.ac),
            PipelineConfig(schedule=c.schedule, microbatches=c.microbatches, virtual=c.virtual),
        ).check(cfg, 2**seq_exp, hw.gpus * batch_mult, c.microbatches)
    assert why_best(result)


def _activations_block_by_block(cfg, cand: Candidate, hw: Hardware, pp_rank: int, in_flight: int, seq_len, batch):
    """A rank's activation bytes as the sum of every block's own count (no grouping of alike blocks)."""
    from tessera.topology.estimators.rank_memory import layer_activation_bytes
    from tessera.topology.schedules.schedule import placement_of, stages_on_rank
    from tessera.topology.shapes import split_layers

    lay, e = cand.layout, hw.dtype_bytes
    mb_rows, seq = batch // lay.dp // cand.microbatches, seq_len // lay.cp
    blocks_of = split_layers(cfg.n_layers, lay.pp * cand.virtual)
    chunks = [blocks_of[s] for s in stages_on_rank(pp_rank, lay.pp, cand.virtual, placement_of(cand.schedule))]

    def act(ac, i):
        return layer_activation_bytes(cfg, mb_rows, seq, lay.tp, cand.sequence_parallel, ac, e, lay.cp, i, e >= 4)

    if cand.ac == "selective":
        return in_flight * max(sum(act("full" if (i - c.start) % 2 == 0 else "none", i) for i in c) for c in chunks)
    recompute = {"none": lambda i: 0.0, "full": lambda i: act("none", i), "op": lambda i: act("none", i) - act("op", i)}
    most = max((recompute[cand.ac](i) for c in chunks for i in c), default=0.0)
    return in_flight * max(sum(act(cand.ac, i) for i in c) for c in chunks) + most


# presets whose blocks are all alike and whose blocks differ (sliding and full, dense and MoE)
ALIKE_BLOCKS = ("debug", "qwen3-moe-debug", "gpt-oss-debug", "deepseek-v3-debug")


@functools.cache
def _candidates_on_8(name: str) -> list:
    return candidates(model_shape(name), Hardware(gpus=8), 64, 16)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_planner_counts_a_ranks_activations_as_the_sum_of_its_blocks(data):
    """The planner counts one block of each kind and multiplies; the sum over every block is the same bytes."""
    from tessera.topology.estimators.planner import fsdp_degree
    from tessera.topology.estimators.rank_memory import _rank_memory
    from tessera.topology.estimators.step_estimate import pipeline_profile

    name = data.draw(st.sampled_from(ALIKE_BLOCKS))
    cand = data.draw(st.sampled_from(_candidates_on_8(name)))
    cfg, hw, lay = as_shape(model_shape(name)), Hardware(gpus=8), cand.layout
    _, in_flight = pipeline_profile(cand.schedule, lay.pp, cand.microbatches, cand.virtual)
    pp_rank = data.draw(st.sampled_from(sorted({0, lay.pp - 1})))
    mb_rows = 16 // lay.dp // cand.microbatches
    counted = _rank_memory(cfg, cand, hw, pp_rank, in_flight[pp_rank], mb_rows, 64 // lay.cp, fsdp_degree(lay))
    assert counted["activations"] == _activations_block_by_block(cfg, cand, hw, pp_rank, in_flight[pp_rank], 64, 16), (
        name,
        cand,
    )


def test_memory_model_directions():
    """Checkpointing saves memory and costs time; SHARD_GRAD_OP holds the gathered stage; tp beyond the kv
    heads holds the whole K/V weights (the planner counts them, an even 1/tp split would not)."""
    cfg, hw = model_shape("8b"), Hardware(gpus=16)
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
    out = _tessera(
        "plan",
        "--model",
        "405b",
        "--gpus",
        "4096",
        "--seq-len",
        "8192",
        "--global-batch",
        "1024",
        "--top",
        "3",
        "--dry-run",
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert (
        lines[0].startswith("405b on 4096 GPUs of 80 GB")
        and len([ln for ln in lines[2:] if ln[:3].strip().isdigit()]) == 3
    )
    assert any(ln.startswith("best: tessera train --") for ln in lines) and any(
        ln.startswith("why: it") for ln in lines
    )
    counted = next(ln for ln in lines if ln.startswith("model states of the rank holding the most"))
    numbers = [float(w) for w in counted.replace(",", " ").split() if w.replace(".", "").isdigit()]
    assert numbers[0] == pytest.approx(numbers[1], rel=1e-3)  # the estimate's states are the exact count


def test_plan_cli_json():
    out = _tessera(
        "plan", "--model", "8b", "--gpus", "16", "--seq-len", "4096", "--global-batch", "32", "--json", "--top", "4"
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["ranked"]) == 4 and data["request"]["hardware"]["gpus"] == 16
    top = data["ranked"][0]
    assert set(top["memory_bytes"]) >= {"parameters", "activations", "total"} and top["time_s"]["step"] > 0
    assert top["flags"].startswith("--") and 0 < top["mfu"] < 1


@pytest.mark.parametrize(
    "name, message",
    [
        ("dp4xtp2", r"--layout dp4xtp2 is 8 ranks and --gpus is 16: name a layout of 16 ranks"),
        ("dq16", r"--layout 'dq16': 'dq16' is not <axis><degree>"),
    ],
)
def test_a_named_layout_that_cannot_be_scored_is_refused(name, message):
    from tessera.commands.plan_layout import parse_named_layout
    from tessera.topology.errors import PlanError

    with pytest.raises(PlanError, match=message):
        parse_named_layout(name, 16)


def test_plan_scores_a_named_layout_beside_the_ranking():
    """--layout: the best layout named is ranked 1; another is placed where the full ranking puts its best
    settings, with what the best gains over it; one that cannot fit says its shortfall; one tessera would not
    run says why. One plan (8b on 16 GPUs of 40 GB), scored in process; the CLI prints the same verdict."""
    from tessera.commands.plan_layout import parse_named_layout, score_layout
    from tessera.topology.estimators.planner import plan

    shape, hw = model_shape("8b"), Hardware.from_profile("h100-sxm-80gb", 16, gpu_memory_gb=40)  # the CLI's default
    ranked = plan(shape, hw, 4096, 32).ranked  # every fitting layout, best first

    class Result:  # what score_layout reads of a plan
        pass

    result = Result()
    result.ranked = ranked

    def score(name):
        return score_layout(shape, hw, 4096, 32, result, *parse_named_layout(name, 16))

    lay = ranked[0].candidate.layout
    name = "x".join(
        f"{k}{v}"
        for k, v in (("pp", lay.pp), ("dpr", lay.dp_replicate), ("dp", lay.dp_shard), ("cp", lay.cp), ("tp", lay.tp))
        if v > 1
    )
    assert score(name)["rank"] == 1 and score(name)["verdict"].startswith(f"ranked 1 of {len(ranked)}")
    got = score("pp4xdp2xcp2")
    mine = [
        i
        for i, x in enumerate(ranked, 1)
        if (x.candidate.layout.pp, x.candidate.layout.dp_shard, x.candidate.layout.cp, x.candidate.layout.tp)
        == (4, 2, 2, 1)
    ]
    assert got["fits"] and got["rank"] == mine[0] > 1
    assert got["estimate"]["time_s"]["step"] == pytest.approx(ranked[mine[0] - 1].time["step"])
    assert "which wins by" in got["verdict"] and "tessera train --pp 4 --cp 2 --dp 2" in got["verdict"]
    # the CLI names the model: its verdict's command is the whole one (the model, the sequence, the batch)
    got = score_layout(shape, hw, 4096, 32, result, *parse_named_layout("pp4xdp2xcp2", 16), model="8b")
    assert (
        "run it with: tessera train --model 8b --seq-len 4096 --global-batch 32 --pp 4 --cp 2 --dp 2"
        in (got["verdict"])
    )
    assert re.fullmatch(
        r"does not fit: its least-memory settings \(dp_replicate16, no FSDP, ac full, mb 1\) need "
        r"\d+\.\d GB per rank against 36\.0 GB usable, short by \d+\.\d GB",
        score("dpr16")["verdict"],
    )
    assert score("dp16xep2")["verdict"] == (
        "tessera would not run it: ep=2 needs a mixture-of-experts model (llama has no experts); use ep 1, or a "
        "model with experts such as qwen3-moe-debug"
    )
    text = _tessera(
        "plan",
        "--model",
        "8b",
        "--gpus",
        "16",
        "--gpu-memory",
        "40",
        "--seq-len",
        "4096",
        "--global-batch",
        "32",
        "--top",
        "1",
        "--layout",
        "pp4xdp2xcp2",
    ).stdout
    assert f"--layout pp4xdp2xcp2: {got['verdict']}" in text, text


@pytest.mark.parametrize(
    "args, message",
    [
        (  # (with offload it would: the host's 2 TB hold 70B's states; --offload none plans without)
            ["--model", "70b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "8", "--offload", "none"],
            r"70b does not fit on 8 GPUs of 80 GB .* needs \d+\.\d GB per rank against 72\.0 GB usable .* short by"
            r".*\(with --offload none\)$",
        ),
        (  # 405B's 6.5 TB of states fit neither the GPUs nor a node's host memory
            ["--model", "405b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "8"],
            r"405b does not fit on 8 GPUs .* with --offload optimizer or --offload params neither fits either "
            r"\(the node's 2048 GB of host memory included\)$",
        ),
        (
            ["--model", "8b", "--gpus", "12", "--gpus-per-node", "8", "--seq-len", "4096", "--global-batch", "12"],
            r"--gpus 12 is not a whole number of nodes of 8",
        ),
        (
            ["--model", "nope", "--gpus", "8", "--seq-len", "4096", "--global-batch", "8"],
            r"unknown model preset 'nope'",
        ),
        (
            ["--model", "debug", "--gpus", "64", "--seq-len", "30", "--global-batch", "3"],
            r"no layout of 64 GPUs runs debug",
        ),
        (
            ["--model", "8b", "--gpus", "64", "--seq-len", "4096", "--global-batch", "64", "--peak-tflops", "inf"],
            r"--peak-tflops inf must be a positive, finite number",
        ),
        # issue 40: --efficiency 5 planned at "500% of 989 TFLOP/s" with an MFU of 451%
        *(
            (
                ["--model", "8b", "--gpus", "64", "--seq-len", "4096", "--global-batch", "64", "--efficiency", share],
                rf"^tessera plan: error: --efficiency {said} must be in \(0, 1\]: the framework's software "
                rf"efficiency, the share of the kernels' rates of h100-sxm-80gb a step reaches; use e\.g\. "
                rf"--efficiency 1 \(tessera's\)$",
            )
            for share, said in (("5", "5"), ("0", "0"), ("-0.3", "-0.3"), ("nan", "nan"), ("1.5", "1.5"))
        ),
    ],
)
def test_plan_cli_refuses_with_one_line(args, message):
    import re

    out = cli_here("plan", *args)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and re.search(message, out.stderr), out.stderr


def test_an_efficiency_of_one_plans_and_the_library_names_its_parameter():
    request = ["--model", "debug", "--gpus", "2", "--seq-len", "64", "--global-batch", "4"]
    assert cli_here("plan", *request, "--efficiency", "1").returncode == 0
    with pytest.raises(PlanError, match=r"^efficiency=5 must be in \(0, 1\]: the share of `peak_tflops`"):
        Hardware(gpus=8, efficiency=5)


def _train_config(command: str):
    """The Config `tessera train` builds from a printed command line (its words after `tessera train`)."""
    import shlex

    from tessera.cli import build_parser
    from tessera.config import config_from_args

    words = shlex.split(command)
    assert words[:2] == ["tessera", "train"], command
    args = build_parser().parse_args(words[1:])
    return config_from_args(args)


def test_the_best_line_is_a_train_command_that_reproduces_the_plan():
    """Issue 40: `best:` printed the layout flags alone, so pasting it trained the debug model at the default
    sequence and batch. Every command the plan prints (the best line, and each ranked layout's in --json)
    parses back through `tessera train`'s parser into the planned model, sequence, batch and layout."""
    request = ["--model", "small", "--gpus", "8", "--seq-len", "256", "--global-batch", "16", "--top", "40"]
    text = cli_here("plan", *request).stdout
    best = next(ln for ln in text.splitlines() if ln.startswith("best: ")).removeprefix("best: ")
    ranked = json.loads(cli_here("plan", *request, "--json").stdout)["ranked"]
    assert best == ranked[0]["command"]
    assert any(r["layout"]["pp"] > 1 and r["virtual"] > 1 for r in ranked)  # schedules and virtual stages too
    for row in ranked:
        config = _train_config(row["command"])
        assert (config.model.preset, config.data.seq_len, config.data.global_batch) == ("small", 256, 16)
        lay = config.layout
        assert {k: getattr(lay, k) for k in row["layout"]} == row["layout"], row["command"]
        assert config.microbatches == row["microbatches"] and config.virtual == row["virtual"], row["command"]
        assert (config.parallel.schedule or "1f1b") == row["schedule"] or lay.pp == 1, row["command"]
        assert config.parallel.ac == row["ac"] and config.parallel.sequence_parallel == row["sequence_parallel"]
        assert config.parallel.fsdp == row["strategy"] or lay.dp_shard * lay.cp == 1, row["command"]


CPU_CALIBRATION = dict(
    device_kind="cpu: Test CPU, 1 thread",
    dtype="float32",
    matmul_flops_per_s=1e11,
    attention_flops_per_s=2e10,
    memory_bytes_per_s=4e10,
    op_overhead_s=4e-6,
    device_type="cpu",
)


@pytest.fixture
def cpu_calibration(tmp_path):
    from tessera.topology.estimators.step_time import SCHEMA

    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"schema": SCHEMA, "entries": {"cpu: Test CPU | float32": CPU_CALIBRATION}}))
    return path


@pytest.mark.parametrize("gpus, ranks", [("1", "1 CPU rank"), ("2", "2 CPU ranks")])
def test_a_cpu_calibrated_plan_says_what_it_planned_and_shows_no_false_mfu(cpu_calibration, gpus, ranks):
    """Issue 40: with a CPU calibration the header said "1 GPUs of 80 GB", every MFU read 0.0% (against an
    H100's peak), and "why" said "less recomputation" of two layouts that recompute nothing. Each CPU rank holds
    its share of this host's memory (it said 80 GB, the GPU profile's)."""
    from tessera.launching.host_memory import total_bytes

    host = total_bytes()
    ranks += f" of {host / 1e9 / int(gpus):.4g} GB of host memory" if host else " of 80 GB"
    request = ["--model", "small", "--gpus", gpus, "--seq-len", "128", "--global-batch", "8"]
    out = cli_here("plan", *request, "--device-kind", "cpu", "--calibration", str(cpu_calibration), "--top", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"small on {ranks} (8 per node; the CPU calibration 'cpu: Test CPU, 1 thread')")
    assert "GPU" not in lines[0]
    rows = [ln for ln in lines if ln[:3].strip().isdigit()]
    assert rows and all(ln.split()[-1] == "-" for ln in rows)  # no MFU without a peak
    assert "no MFU: a calibration measures rates, not a peak" in lines[-1]
    why = next(ln for ln in lines if ln.startswith("why: "))
    assert "recomputation" not in why or "ac none against ac op" in why, why  # recomputation only where it differs
    if gpus == "1":  # ac none, mb 1 against ac none, mb 2: the second microbatch's operators
        assert (
            why.startswith("why: it wins by fewer operators for the host to dispatch (") and "mb 1 against mb 2" in why
        )
    best = next(ln for ln in lines if ln.startswith("best: ")).removeprefix("best: ")
    assert _train_config(best).runtime.device == "cpu"  # the plan's ranks are CPU ranks
    # a peak given: MFU against it
    out = cli_here(
        "plan", *request, "--device-kind", "cpu", "--calibration", str(cpu_calibration), "--peak-tflops", "0.1"
    )
    rows = [ln for ln in out.stdout.splitlines() if ln[:3].strip().isdigit()]
    assert all(ln.split()[-1].endswith("%") and ln.split()[-1] != "0.0%" for ln in rows), out.stdout
    assert "(MFU against --peak-tflops 0.1)" in out.stdout


def test_the_reason_a_layout_wins_names_what_differs_in_it():
    """ "less recomputation" only where the faster layout's checkpointing recomputes less; every reason names
    the settings that differ (calibrated and not)."""
    from tessera.topology.estimators.planner import RECOMPUTE, gain_text
    from tessera.topology.estimators.step_time import Calibration

    shape = model_shape("small")
    for hw in (Hardware(gpus=2), Hardware(gpus=2, calibration=Calibration(**CPU_CALIBRATION))):
        ranked = plan(shape, hw, 128, 8).ranked
        best = ranked[0]
        for other in ranked[1:]:
            label, seconds = wins_by(best, other)
            if "recomputation" in label:
                assert RECOMPUTE[best.candidate.ac] < RECOMPUTE[other.candidate.ac], (label, other.candidate)
            text = gain_text(best, other)
            assert text.startswith(f"{label} ({seconds:.3f} s/step; ") and " against " in text, text


# ----------------------------------------------------------------------------- model shapes
@st.composite
def model_shapes(draw, max_layers: int = 6) -> ModelShape:
    """Random decoder shapes over every option a ModelShape has (head_dim independent of dim)."""
    kv = draw(st.integers(1, 4))
    return ModelShape(
        dim=draw(st.integers(1, 48)),
        n_layers=draw(st.integers(1, max_layers)),
        n_heads=kv * draw(st.integers(1, 4)),
        n_kv_heads=kv,
        head_dim=2 * draw(st.integers(1, 12)),
        vocab_size=draw(st.integers(1, 500)),
        ffn_dim=draw(st.integers(1, 96)),
        mlp=draw(st.sampled_from(["swiglu", "gelu"])),
        norm=draw(st.sampled_from(["rms", "layer"])),
        qk_norm=draw(st.booleans()),
        tied_embeddings=draw(st.booleans()),
        bias=draw(st.booleans()),
        learned_positions=draw(st.sampled_from([0, 0, 1, 7, 64])),
    )


def _numel(units) -> int:
    return sum(r * c for u in units for r, c in u)


@settings(max_examples=300, deadline=None)
@given(model_shapes(), st.data())
def test_the_stages_hold_every_parameter_once_but_a_tied_heads_copy(shape, data):
    """Over a pipeline's stages (one rank of tp each): num_params, plus the copy of a tied embedding that a
    last stage after the first holds."""
    n_stages = data.draw(st.integers(1, shape.n_layers))
    layers = stage_layer_counts(shape.n_layers, n_stages)
    held = sum(_numel(stage_param_shapes(shape, 1, s == 0, s == n_stages - 1, layers[s])) for s in range(n_stages))
    copy = shape.vocab_size * shape.dim if shape.tied_embeddings and n_stages > 1 else 0
    assert held == shape.num_params() + copy
    assert _numel([layer_param_shapes(shape, 1)]) == shape.block_params()


@settings(max_examples=200, deadline=None)
@given(model_shapes(max_layers=2), st.sampled_from([2, 4]))
def test_tp_ranks_split_every_matrix_and_replicate_the_rest(shape, tp):
    """Summed over the tp ranks of one stage, a block holds its matrices once and each replicated vector
    (norms, qk-norms, the row-parallel biases) tp times, with tp dividing the heads, kv heads and width."""
    shape = ModelShape(
        **{
            **shape.__dict__,
            "n_heads": shape.n_heads * tp,
            "n_kv_heads": shape.n_kv_heads * tp,
            "ffn_dim": shape.ffn_dim * tp,
            "vocab_size": shape.vocab_size * tp,
            "learned_positions": shape.learned_positions * tp,
        }
    )
    replicated = (
        2 * shape.norm_params + (2 * shape.head_dim if shape.qk_norm else 0) + (2 * shape.dim if shape.bias else 0)
    )
    assert tp * _numel([layer_param_shapes(shape, tp)]) == shape.block_params() + (tp - 1) * replicated
    whole = sum(_numel(stage_param_shapes(shape, tp, True, True, shape.n_layers)) for _ in range(tp))
    assert whole == shape.num_params() + (tp - 1) * (shape.n_layers * replicated + shape.norm_params)


@given(model_shapes(), st.integers(1, 4096))
def test_flops_count_the_mlps_matrices_the_head_and_the_heads_attention(shape, seq):
    """6 x (matmul parameters: the blocks, the final norm and the head, never the lookup tables) + 6 x layers
    x heads x head_dim x seq; a GELU MLP has two matrices, SwiGLU three; tying the head changes nothing."""
    q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    h, f = shape.dim, shape.ffn_dim
    block = h * (2 * q + 2 * kv) + (3 if shape.mlp == "swiglu" else 2) * h * f + 2 * shape.norm_params
    block += (q + 2 * kv + h + (2 if shape.mlp == "swiglu" else 1) * f + h) if shape.bias else 0
    block += 2 * shape.head_dim if shape.qk_norm else 0
    matmul = shape.n_layers * block + shape.norm_params + shape.vocab_size * h
    expected = 6 * matmul + 6 * shape.n_layers * q * seq
    assert model_flops_per_token(shape, seq) == pytest.approx(expected, rel=1e-12)
    other = {"swiglu": "gelu", "gelu": "swiglu"}[shape.mlp]
    swapped = ModelShape(**{**shape.__dict__, "mlp": other})
    gelu, swiglu = (shape, swapped) if shape.mlp == "gelu" else (swapped, shape)
    bias = f if shape.bias else 0
    assert model_flops_per_token(swiglu, seq) - model_flops_per_token(gelu, seq) == pytest.approx(
        6 * shape.n_layers * (h * f + bias)
    )
    tied = ModelShape(**{**shape.__dict__, "tied_embeddings": not shape.tied_embeddings})
    assert model_flops_per_token(tied, seq) == pytest.approx(model_flops_per_token(shape, seq))


def test_a_gelu_mlp_counts_two_matrices():
    swiglu = ModelShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, vocab_size=100, ffn_dim=256)
    gelu = ModelShape(**{**swiglu.__dict__, "mlp": "gelu", "norm": "layer", "bias": True, "learned_positions": 32})
    assert [r * c for r, c in layer_param_shapes(gelu, 1)].count(64 * 256) == 2
    assert [r * c for r, c in layer_param_shapes(swiglu, 1)].count(64 * 256) == 3
    lookups = 100 * 64 + 32 * 64
    assert model_flops_per_token(gelu, 1) == 6 * (gelu.num_params() - lookups) + 6 * 2 * 64
    # a GELU MLP keeps two ffn-wide activations for backward where SwiGLU keeps four
    from tessera.topology.estimators.rank_memory import layer_activation_bytes

    acts = {s.mlp: layer_activation_bytes(s, 1, 8, 1, False, "none", 4) for s in (swiglu, gelu)}
    assert acts["swiglu"] - acts["gelu"] > 2 * 8 * 256 * 4


def test_qwen3s_head_dim_is_its_own():
    """Qwen3-0.6B: dim 1024, 16 heads of 128: q is 2048 wide, attention FLOPs count 16 x 128 per layer."""
    shape = model_shape("qwen3-0.6b")
    assert shape.head_dim == 128 and shape.qk_norm and shape.tied_embeddings
    assert layer_param_shapes(shape, 2)[1] == (16 * 128 // 2, 1024)
    assert shape.num_params() == get_preset("qwen3-0.6b").num_params()
    base = model_flops_per_token(shape, 0)
    assert model_flops_per_token(shape, 4096) - base == 6 * 28 * 2048 * 4096
    with pytest.raises(TypeError, match="spec_of"):
        as_shape(get_preset("qwen3-0.6b"))  # another family's config is not read by names: its spec says


@pytest.mark.parametrize("model", ["debug", "small", "1b", "8b", "70b", "405b"])
def test_a_llama_config_reads_as_its_specs_shape(model):
    cfg = get_preset(model)
    assert as_shape(cfg) == model_shape(model) and model_shape(cfg) == model_shape(model)
    assert as_shape(cfg).max_seq_len == cfg.max_seq_len


@settings(max_examples=60, deadline=None)
@given(
    model=st.sampled_from(["debug", "small", "8b", "qwen3-0.6b", "qwen3-debug"]),
    tp=st.sampled_from([1, 2, 3, 4, 8, 16]),
    cp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([1, 2, 3, 4, 8, 64]),
    dp=st.sampled_from([1, 2, 3]),
    strategy=st.sampled_from(STRATEGIES),
    ac=st.sampled_from(AC_MODES),
    schedule=st.sampled_from(SCHEDULES),
    mb=st.sampled_from([1, 2, 3, 4, 8]),
    virtual=st.sampled_from([1, 2, 4]),
    sp=st.sampled_from([None, False]),
    seq=st.sampled_from([24, 64, 96, 4096]),
    batch=st.sampled_from([3, 8, 12, 48]),
)
def test_the_planners_validity_checks_are_tesseras_own(
    model, tp, cp, pp, dp, strategy, ac, schedule, mb, virtual, sp, seq, batch
):
    """The planner decides what runs without importing tessera.parallel: the same answer as ParallelConfig.check."""
    from tessera.parallel.fsdp import DataParallelConfig
    from tessera.parallel.parallelize import ParallelConfig
    from tessera.parallel.pipeline import PipelineConfig

    cand = Candidate(Layout(pp=pp, dp_shard=dp, cp=cp, tp=tp), strategy, ac, schedule, mb, virtual, sp)
    try:
        ParallelConfig(
            cand.layout,
            cand.sequence_parallel,
            DataParallelConfig(strategy, "bf16", ac),
            PipelineConfig(schedule=schedule, microbatches=mb, virtual=virtual),
        ).check(get_preset(model), seq, batch, mb)
        runs = True
    except ValueError:
        runs = False
    assert (why_not_runnable(model_shape(model), cand, seq, batch) is None) == runs


def test_the_candidates_of_a_preset_are_those_tessera_runs():
    """Every candidate passes ParallelConfig.check; the count is today's for the 8b preset on 16 GPUs."""
    from tessera.parallel.fsdp import DataParallelConfig
    from tessera.parallel.parallelize import ParallelConfig
    from tessera.parallel.pipeline import PipelineConfig

    hw, cfg = Hardware(gpus=16), get_preset("8b")
    cands = candidates(model_shape("8b"), hw, 4096, 32)
    # 2127 before interleaved-zb, zbv and looped-bfs (v2) joined the schedules, 2697 before dualpipev (v2, m >= 2pp)
    assert len(cands) == 2757
    for c in cands[::7]:
        ParallelConfig(
            c.layout,
            c.sequence_parallel,
            DataParallelConfig(c.strategy, "bf16", c.ac),
            PipelineConfig(schedule=c.schedule, microbatches=c.microbatches, virtual=c.virtual),
        ).check(cfg, 4096, 32, c.microbatches)


def test_topology_counts_without_torch_or_the_layers_above_it():
    """The planner, the memory, communication and step-time models and the schedules import no torch, no
    tessera.models, no tessera.parallel and nothing of the runtime."""
    code = (
        "import sys\n"
        "import tessera.topology.estimators.planner, tessera.topology.estimators.comm_model\n"
        "import tessera.topology.estimators.step_time, tessera.topology.memory, tessera.topology.schedules.schedule\n"
        "import tessera.topology.shapes, tessera.topology.layout\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('tessera.models', "
        "'tessera.parallel', 'tessera.kernels')) or m.count('.') == 1 and m.startswith('tessera.') and "
        "not m.startswith('tessera.topology')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_plan_takes_a_shape_not_a_name():
    with pytest.raises(TypeError, match="ModelShape"):
        plan("8b", Hardware(gpus=8), 4096, 8)
    result = plan(model_shape("qwen3-0.6b"), Hardware(gpus=8), 4096, 16, top=2, name="qwen3-0.6b")
    assert result.request["model"] == "qwen3-0.6b" and result.request["params"] == get_preset("qwen3-0.6b").num_params()


def test_plan_counts_muons_state_when_asked_and_trains_with_it():
    """`tessera plan --optimizer muon`: less optimizer state per rank than AdamW's (one momentum on the
    matrices), said in the assumptions, and the printed train command runs Muon."""
    args = ["--model", "8b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "16", "--top", "1"]
    adam, muon = _tessera("plan", *args, "--json"), _tessera("plan", *args, "--json", "--optimizer", "muon")
    assert adam.returncode == 0 and muon.returncode == 0, adam.stderr + muon.stderr
    best = [json.loads(out.stdout)["ranked"][0] for out in (adam, muon)]
    assert best[1]["memory_bytes"]["optimizer"] < best[0]["memory_bytes"]["optimizer"]
    assert best[1]["command"].endswith("--optimizer muon") and "--optimizer" not in best[0]["command"]
    text = _tessera("plan", *args, "--optimizer", "muon")
    assert "best: tessera train" in text.stdout and text.stdout.split("best: ")[1].split("\n")[0].endswith(
        "--optimizer muon"
    )
    assert "Muon's momentum on the matrices" in text.stdout


@settings(max_examples=80, deadline=None)
@given(
    n_layers=st.integers(1, 8),
    heads=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([8, 16, 64]),
    seq=st.integers(1, 8192),
    window=st.integers(1, 16384),
    narrower=st.integers(1, 16384),
    data=st.data(),
)
def test_a_sliding_window_never_raises_the_attention_flops(n_layers, heads, head_dim, seq, window, narrower, data):
    """A sliding block attends to at most `window` keys: its FLOPs never exceed full causal attention's, never
    rise as the window narrows, and equal full attention's once the window covers the sequence."""
    full = ModelShape(
        dim=64, n_layers=n_layers, n_heads=heads, n_kv_heads=heads, head_dim=head_dim, vocab_size=100, ffn_dim=128
    )
    layers = tuple(sorted(data.draw(st.sets(st.integers(0, n_layers - 1), min_size=1))))

    def sliding(w: int) -> ModelShape:
        return ModelShape(**{**full.__dict__, "sliding_window": w, "sliding_layers": layers})

    assert model_flops_per_token(sliding(window), seq) <= model_flops_per_token(full, seq)
    assert model_flops_per_token(sliding(min(window, narrower)), seq) <= model_flops_per_token(sliding(window), seq)
    covering = sliding(seq + data.draw(st.integers(0, 1000)))
    assert model_flops_per_token(covering, seq) == pytest.approx(model_flops_per_token(full, seq), rel=1e-12)


def test_latent_and_sliding_attention_flops():
    """DeepSeek-V3's scores run at the qk head dim (128 + 64 = 192), its weighted sum at v_head_dim 128;
    gpt-oss's sliding blocks attend to at most 128 keys."""
    from tessera.topology.estimators.step_time import attention_flops_per_token

    v3 = model_shape("deepseek-v3-671b")
    assert (v3.head_dim, v3.v_head_dim) == (192, 128)
    # per block forward: 2 x heads x seq / 2 keys x (192 + 128), three times that with backward
    assert attention_flops_per_token(v3, 4096) == 6 * 61 * 128 * (192 + 128) // 2 * 4096
    oss = model_shape("gpt-oss-20b")
    assert oss.sliding_window == 128 and len(oss.sliding_layers) == 12
    full = 6 * 12 * 64 * 64 * 4096  # the 12 full blocks: 6 x heads x head_dim x seq
    window = 6 * 12 * 64 * 128 * (128 - 128 * 128 / (2 * 4096))  # 12 sliding: 2 x head_dim x the keys seen
    assert attention_flops_per_token(oss, 4096) == pytest.approx(full + window, rel=1e-12)


def test_the_why_line_names_a_tie_that_holds_less_memory_than_the_best():
    """The ranking is by time alone; where a layout within 0.1% of the best holds less memory, the why line
    names it (a new user's report: it said the best held the least)."""
    result = plan(model_shape("8b"), Hardware.from_profile("h100-sxm-80gb", 8), 2048, 47)
    best = result.ranked[0]
    ties = [x for x in result.ranked[1:] if x.time["step"] <= best.time["step"] * 1.001]
    least = min([best, *ties], key=lambda x: x.memory["total"])
    text = why_best(result)
    assert ties and least is not best, "the example no longer ties: pick another"
    assert f"of them {least.candidate.describe()} holds the least memory" in text, text
    assert "it holds the least memory" not in text


def test_a_cpu_calibrated_plan_of_no_ranks_is_refused_in_one_line(cpu_calibration):
    """The host's share per CPU rank divided by --gpus before --gpus was checked (a ZeroDivisionError)."""
    out = cli_here(
        "plan", "--model", "small", "--gpus", "0", "--seq-len", "128", "--global-batch", "8",
        "--device-kind", "cpu", "--calibration", str(cpu_calibration),
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.strip() == "tessera plan: error: --gpus 0 must be a positive integer"

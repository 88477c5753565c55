import json

import pytest

from helpers import cli_here
from hypothesis import given
from hypothesis import strategies as st
from tessera.topology.memory import RECIPES, min_gpus, model_state_bytes

GB = 1e9


@pytest.mark.parametrize(
    "stage, params, grads, optim, total",
    [
        (0, 140.0, 140.0, 840.0, 1120.00),
        (1, 140.0, 140.0, 3.28, 283.28),
        (2, 140.0, 0.55, 3.28, 143.83),
        (3, 0.55, 0.55, 3.28, 4.38),
    ],
)
def test_reference_zero_table_70b_on_256(stage, params, grads, optim, total):
    m = model_state_bytes(70e9, dp=256, zero_stage=stage)
    assert round(m["parameters"] / GB, 2) == params
    assert round(m["gradients"] / GB, 2) == grads
    assert round(m["optimizer"] / GB, 2) == optim
    assert round(m["total"] / GB, 2) == total


def test_fsdp_strategy_names_map_to_stages():
    for name, stage in [("NO_SHARD", 0), ("SHARD_GRAD_OP", 2), ("FULL_SHARD", 3)]:
        assert model_state_bytes(70e9, dp=256, strategy=name) == model_state_bytes(70e9, dp=256, zero_stage=stage)
    hybrid = model_state_bytes(70e9, dp=256, strategy="HYBRID_SHARD", shard_size=8)
    assert hybrid["total"] == pytest.approx(1120e9 / 8)
    with pytest.raises(ValueError, match="shard_size"):
        model_state_bytes(70e9, dp=256, strategy="HYBRID_SHARD")


def test_gpu_floor_and_fp32_recipe():
    assert min_gpus(70e9, 80) == 14
    assert RECIPES["fp32_adam"].bytes_per_param == 16 and RECIPES["mixed_adam"].bytes_per_param == 16
    assert model_state_bytes(1e9, recipe="fp32_adam")["parameters"] == 4e9


@given(st.floats(1e6, 1e12), st.integers(1, 4096), st.sampled_from(list(RECIPES)))
def test_stages_never_grow_and_stage3_divides_everything(n, dp, recipe):
    totals = [model_state_bytes(n, dp=dp, zero_stage=s, recipe=recipe)["total"] for s in range(4)]
    assert all(a >= b for a, b in zip(totals, totals[1:]))
    assert totals[3] == pytest.approx(totals[0] / dp)
    for s in range(4):
        m = model_state_bytes(n, dp=dp, zero_stage=s, recipe=recipe)
        assert m["total"] == pytest.approx(m["parameters"] + m["gradients"] + m["optimizer"])


@pytest.mark.parametrize(
    "kwargs", [dict(dp=0), dict(dp=2.5), dict(zero_stage=4), dict(recipe="adam8"), dict(strategy="ZERO")]
)
def test_bad_input(kwargs):
    with pytest.raises(ValueError):
        model_state_bytes(1e9, **kwargs)


def test_cli_prints_the_reference_table():
    out = cli_here("memory", "--params", "70e9", "--dp", "256", "--gpu-memory", "80").stdout
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert total.split() == ["total", "1120.00", "GB", "283.28", "GB", "143.83", "GB", "4.38", "GB"]
    assert "raw floor: 14 GPUs of 80 GB" in out
    bad = cli_here("memory", "--params", "70e9", "--dp", "0")
    assert bad.returncode == 2 and "--dp 0 must be a positive integer; use --dp 1 or more" in bad.stderr


@pytest.mark.parametrize(
    "argv, want",
    [
        # issue 40: --dp 1000000000000 printed a table of 0.00 GB; 1e12 was argparse's usage block
        (["--dp", "1e12"], "--dp 1e12 must be a whole number of ranks, e.g. --dp 8"),
        (["--tp", "2.5"], "--tp 2.5 must be a whole number of ranks, e.g. --tp 8"),
        (["--dp-replicate", "two"], "--dp-replicate two must be a whole number of ranks, e.g. --dp-replicate 8"),
        (
            ["--dp", "1000000000000"],
            "--dp 1,000,000,000,000 is more ranks than any job has (at most 1,048,576, 2**20, on one axis); give "
            "the job's own degree, e.g. --dp 256",
        ),
        (
            ["--dp", "1048576", "--tp", "8", "--dp-replicate", "2"],
            "--dp 1048576 x --tp 8 is 8,388,608 ranks, more than any job has (at most 1,048,576, 2**20); give the "
            "job's own degrees",
        ),
        (["--cp", "-2"], "--cp -2 must be a positive integer; use --cp 1 or more"),
    ],
)
def test_memory_refuses_a_degree_that_is_no_count_of_ranks_in_one_line(argv, want):
    from helpers import cli_here

    out = cli_here("memory", "--params", "70e9", *argv)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", f"tessera memory: error: {want}\n")


def test_memory_takes_the_largest_degree_it_allows():
    from helpers import cli_here

    out = cli_here("memory", "--params", "70e9", "--dp", str(1 << 20))
    assert out.returncode == 0 and "dp=1048576" in out.stdout


def test_dry_run_70b_on_256_fake_ranks_matches_the_reference():
    from tessera.models import get_preset
    from tessera.parallel.parallelize import dry_run_model_states
    from tessera.topology import Layout

    n = get_preset("70b").num_params()  # 70.55B; the reference's 4.38 GB is for exactly 70.0B
    measured = dry_run_model_states("70b", Layout(dp_shard=256), recipe="mixed_adam", strategy="FULL_SHARD")
    predicted = model_state_bytes(n, dp=256, zero_stage=3)
    for component in ("parameters", "gradients", "optimizer", "total"):
        assert measured[component] == pytest.approx(predicted[component], rel=1e-3)
    assert round(measured["total"] * 70e9 / n / GB, 2) == 4.38
    no_shard = dry_run_model_states("70b", Layout(dp_shard=256), strategy="NO_SHARD")
    assert no_shard["total"] == pytest.approx(16 * n)


def test_the_memory_command_honours_every_axis_it_is_given():
    """tp and pp split the model, FSDP shards over dp_shard x cp, dp_replicate holds copies: no flag is
    silently ignored (tp used to be, without --dry-run)."""
    import contextlib
    import io
    import json as _json

    from tessera.cli import main
    from tessera.models import get_preset
    from tessera.topology.memory import model_state_bytes

    def zero3(*flags):  # in this process (the refusal below runs the command line as a user does)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["memory", "--model", "70b", "--json", *flags]) == 0
        return _json.loads(out.getvalue())["zero3"]["total"]

    params = get_preset("70b").num_params()
    assert zero3("--dp", "4", "--tp", "8") == model_state_bytes(params / 8, dp=4, zero_stage=3)["total"]
    assert zero3("--dp", "4", "--tp", "8") < zero3("--dp", "4")
    assert zero3("--dp", "4", "--cp", "2") == model_state_bytes(params, dp=8, zero_stage=3)["total"]
    assert zero3("--dp", "8", "--dp-replicate", "2") == zero3("--dp", "4")  # HSDP shards over dp_shard only
    assert zero3("--dp", "4", "--pp", "2") == model_state_bytes(params / 2, dp=4, zero_stage=3)["total"]
    bad = cli_here("memory", "--model", "70b", "--dp", "4", "--dp-replicate", "3")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "tessera memory: error: --dp-replicate 3 must divide --dp 4 (dp = dp_replicate x dp_shard); use --dp 3"
    )


def test_the_memory_command_agrees_with_the_planner():
    """With a preset, `tessera memory` also prints the planner's exact count: the same recipe over the
    parameters the rank holding the most really has (tp beyond the kv heads keeps whole K/V weights)."""
    import json as _json

    from tessera.commands.plan import model_shape
    from tessera.topology import Layout
    from tessera.topology.estimators.planner import Candidate, Hardware, estimate

    out = cli_here("memory", "--model", "8b", "--json", "--dp", "4", "--tp", "16", "--pp", "2")
    assert out.returncode == 0, out.stderr
    exact = _json.loads(out.stdout)["planner_zero3"]
    est = estimate(
        model_shape("8b"),
        Candidate(Layout(pp=2, dp_shard=4, tp=16), microbatches=2),
        Hardware(gpus=128, gpus_per_node=16),
        4096,
        8,
    )
    # the planner's table shows the rank with the highest peak (pp rank 0, with more microbatches in flight);
    # memory shows the rank with the most parameters (the last, whose final norm adds 4096 / 4 more)
    assert exact["total"] == pytest.approx(
        est.memory["parameters"] + est.memory["gradients"] + est.memory["optimizer"], rel=1e-4
    )
    assert exact["total"] > _json.loads(out.stdout)["zero3"]["total"]  # the even split misses the replicated K/V


def test_the_readme_memory_example_quotes_what_its_command_prints():
    import re
    from pathlib import Path

    from helpers import cli_here

    readme = (Path(__file__).resolve().parents[1] / "docs" / "layouts.md").read_text()
    command = "tessera memory --model 70b --tp 8 --pp 2 --dp 8 --dp-replicate 2 --cp 2"
    quoted = re.search(re.escape(command) + r"\n(.*?)\ntessera ", readme, re.S).group(1)
    params, states = re.search(
        r"here: ([\d.]+B) parameters per rank, ([\d.]+ GB) of model states at ZeRO-3", quoted
    ).groups()
    out = cli_here(*command.split()[1:]).stdout
    assert f"model states per rank: {params} parameters" in out
    assert re.search(rf"^total .* {re.escape(states)}$", out, re.M), out


def test_a_muon_recipe_says_what_its_table_leaves_out_and_the_planners_line_counts_it():
    out = cli_here("memory", "--model", "8b", "--dp", "8", "--recipe", "mixed_muon", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert "AdamW keeps" in rows["note"]
    exact, table = rows["planner_zero3"], rows["zero3"]
    # the parameters AdamW keeps hold Adam's second moment beyond Muon's one momentum; the owner's gathered matrix
    assert exact["optimizer"] > table["optimizer"] and exact["muon_gathered"] > 0
    assert exact["total"] == exact["parameters"] + exact["gradients"] + exact["optimizer"] + exact["muon_gathered"]


def test_memory_models_expert_parallel_as_train_runs_it():
    """Issue 65 item 11: `tessera memory` had no --ep (it printed the top-level usage), so it could not model
    DeepSeek-V3's expert parallel. Under ep the experts' shards move from FSDP's ranks to ep's and the ranks ep
    leaves, so a rank holds as much as without it; a dense preset is refused in one line."""
    from helpers import cli_here

    with_ep = cli_here("memory", "--model", "deepseek-v3-debug", "--dp", "4", "--ep", "2", "--dry-run")
    without = cli_here("memory", "--model", "deepseek-v3-debug", "--dp", "4", "--dry-run")
    assert with_ep.returncode == without.returncode == 0, with_ep.stderr
    rows = [
        [ln.split(": ", 1)[1] for ln in out.stdout.splitlines() if "FULL_SHARD   :" in ln] for out in (with_ep, without)
    ]
    assert "(dp_shard4 x ep2), FULL_SHARD" in with_ep.stdout and rows[0] == rows[1] and rows[0]
    dense = cli_here("memory", "--model", "debug", "--dp", "4", "--ep", "2")
    assert dense.returncode == 2 and "ep needs a mixture-of-experts model" in dense.stderr

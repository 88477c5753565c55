"""A run is refused before any rank starts when the planner's memory estimate exceeds what this machine holds
(host RAM shared by the local CPU ranks, or a GPU's memory); --force runs it anyway."""

import pytest

from helpers import cli_here

from tessera.config import Config
from tessera.training.estimate import CPU_RANK_RUNTIME_BYTES, fit_problem, planner_estimate

GB = 10**9


def test_a_batch_that_would_grow_until_killed_is_refused_in_one_line_with_the_estimate():
    out = cli_here("train", "--model", "debug", "--global-batch", "1000000000", "--steps", "1")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("tessera train: error: the planner estimates ")
    assert "GB per rank (activations " in lines[0] and "--global-batch 1000000000" in lines[0]
    assert "this machine has available; lower --global-batch" in lines[0] and "--force to run anyway" in lines[0]


def test_more_ranks_than_the_host_holds_are_refused_before_any_forks():
    out = cli_here("train", "--model", "debug", "--dp", "4096", "--global-batch", "4096", "--steps", "1")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "4096 local CPU rank(s)" in lines[0] and "this machine holds about " in lines[0]
    assert "use a smaller layout, torchrun across machines, or pass --force" in lines[0]


def test_the_limit_is_the_estimate_against_the_capacity_and_force_skips_it():
    config = Config.create(model="debug", seq_len=64, global_batch=8, dp=2, device="cpu")
    per_rank = planner_estimate(config).memory["total"]
    need = 2 * (per_rank + CPU_RANK_RUNTIME_BYTES)
    assert fit_problem(config, int(need) + 1, 2, None) is None
    problem = fit_problem(config, int(need) - 1, 2, None)
    assert problem is not None and "2 local CPU rank(s)" in problem and "global_batch=8" in problem
    assert fit_problem(config, None, 2, None) is None  # the host's memory unknown: nothing to judge by
    assert fit_problem(config, 1, 2, int(per_rank) + 1) is None  # a GPU rank: its device's memory only
    assert "more than a GPU's" in fit_problem(config, None, 2, int(per_rank) - 1)
    big = Config.create(model="debug", global_batch=1_000_000_000, steps=1, device="cpu", force=True)
    big.check()  # --force: the estimate is not judged


@pytest.mark.parametrize("flag", ["--force"])
def test_force_is_explained_in_the_help(flag):
    out = cli_here("train", "--help")
    assert flag in out.stdout and "refused before any rank starts" in " ".join(out.stdout.split())

"""The multi-rank harness itself: results come back, failures and hangs fail fast and name the rank."""

import contextlib
import gc
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tessera.launching.launch import RankFailure, RankTimeout, run_ranks


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _rank_two_raises():
    if dist.get_rank() == 2:
        raise ZeroDivisionError("rank two cannot divide")
    dist.barrier()


class _SlowToSay(RuntimeError):
    def __str__(self) -> str:
        time.sleep(1.0)  # its report reaches the parent after rank 0's, which failed later
        return "the first failure"


def _rank_one_fails_first_and_reports_last():
    if dist.get_rank() == 1:
        raise _SlowToSay()
    time.sleep(0.2)
    raise RuntimeError("a failure that follows")


def _rank_one_hangs():
    if dist.get_rank() == 1:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)


def _rank_zero_waits_when_rank_one_fails(folder: str, with_child: bool) -> None:
    """Rank 0 waits, holding a process of its own (as torch.compile's worker pool is) or not; rank 1 fails
    once rank 0 waits. Rank 0's `finally` stops the child and leaves a mark, if rank 0 is let unwind."""
    here = Path(folder)
    if dist.get_rank() == 0:
        child = subprocess.Popen(["sleep", "600"]) if with_child else None
        (here / "waiting").write_text(str(child.pid) if child else "")
        try:
            time.sleep(600)
        finally:
            if child is not None:
                child.terminate()
                child.wait()
            (here / "unwound").write_text("")
    else:
        end = time.monotonic() + 120
        while not (here / "waiting").exists() and time.monotonic() < end:
            time.sleep(0.01)
        raise RuntimeError("rank 1 fails while rank 0 waits")


@pytest.mark.parametrize("with_child", [True, False], ids=["with a child process", "alone"])
def test_a_rank_stopped_by_a_peers_failure_unwinds_and_its_child_goes_with_it(tmp_path, with_child):
    # killed at once, a rank ran no `finally`: its finalizers never unregistered its semaphores (a resource
    # tracker's "leaked semaphore" line) and its child (torch.compile's workers) ran on
    with pytest.raises(RankFailure, match="rank 1 fails while rank 0 waits"):
        run_ranks(_rank_zero_waits_when_rank_one_fails, 2, str(tmp_path), with_child, timeout=120)
    child = (tmp_path / "waiting").read_text()
    try:
        assert (tmp_path / "unwound").exists(), "rank 0 was killed without unwinding"
        if child:
            with pytest.raises(ProcessLookupError):
                os.kill(int(child), 0)
    finally:
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child), 9)  # an orphan of the old way must not outlive the test


def test_results_come_back_in_rank_order_fast():
    start = time.monotonic()
    out = run_ranks(_sum_of_ranks, 16, timeout=60)
    elapsed = time.monotonic() - start
    assert out == [(r, 16, 120.0) for r in range(16)]
    print(f"16 ranks started, all-reduced and joined in {elapsed:.2f}s")


def _collector_state():
    return gc.isenabled(), gc.get_freeze_count(), len(gc.get_objects()), gc.get_stats()[0]["collections"]


def test_a_rank_starts_with_the_preloaded_imports_frozen_out_of_the_collectors_reach():
    """The forkserver imports with its collector paused and freezes its objects before each fork
    (tessera.launching.rank_server): a rank, collector on, inherits ~300,000 objects its full collections never
    walk, and the server's young collections while importing (its counters, inherited: ~680 unpaused) are few."""
    for enabled, frozen, tracked, young in run_ranks(_collector_state, 2, timeout=60):
        assert enabled and frozen > 100_000 and tracked < frozen / 10, (enabled, frozen, tracked)
        assert young < 100, young


def test_a_raising_rank_fails_with_its_traceback():
    # RankFailure, not RankTimeout: the failure is reported when it happens, not at the deadline
    with pytest.raises(RankFailure, match=r"rank 2 of 4 raised:(.|\n)*ZeroDivisionError: rank two cannot divide"):
        run_ranks(_rank_two_raises, 4, timeout=120)


def test_the_rank_that_failed_first_is_reported_even_when_its_report_comes_last():
    # a rank that raises closes its connections and its peers' collectives fail after it ("connection closed
    # by peer"); whichever report reaches the parent first, the error raised is the earliest failure's
    with pytest.raises(RankFailure, match=r"rank 1 of 2 raised:(.|\n)*the first failure") as caught:
        run_ranks(_rank_one_fails_first_and_reports_last, 2, timeout=120)
    assert caught.value.cause is not None and caught.value.cause["message"] == "the first failure"


def test_a_hung_rank_fails_within_the_timeout_naming_rank_and_collective():
    with pytest.raises(RankTimeout) as info:
        run_ranks(_rank_one_hangs, 3, timeout=4)
    stalled = info.value.stalled
    assert sorted(stalled) == [0, 1, 2]
    assert "sleep" in stalled[1] or "_rank_one_hangs" in stalled[1]
    assert "all_reduce" in stalled[0] and "_rank_one_hangs" in stalled[0]
    assert "rank 1: stuck in" in str(info.value)


def _tp_rank_skips_a_collective():
    from tessera.parallel.tensor import reduce_from_tp
    from tessera.topology import Layout, submesh

    mesh = Layout(tp=2).build_mesh("cpu")
    if dist.get_rank() == 1:
        time.sleep(20)  # took another code path: never joins the all-reduce
        return None
    return reduce_from_tp(torch.ones(3), submesh(mesh, "tp").get_group())


def test_a_stalled_model_collective_names_rank_axis_and_operation():
    # a RankFailure naming the collective (gloo's 2 s timeout), not the 60 s deadline's RankTimeout
    with pytest.raises(RankFailure, match=r"rank 0 stalled in all_reduce over the tp axis \(group ranks \[0, 1\]\)"):
        run_ranks(_tp_rank_skips_a_collective, 2, timeout=60, collective_timeout=2)

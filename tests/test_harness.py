"""The multi-rank harness itself: results come back, failures and hangs fail fast and name the rank."""

import time

import pytest
import torch
import torch.distributed as dist

from tessera.parallel.launch import RankFailure, RankTimeout, run_ranks


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


def test_results_come_back_in_rank_order_fast():
    start = time.monotonic()
    out = run_ranks(_sum_of_ranks, 16, timeout=60)
    elapsed = time.monotonic() - start
    assert out == [(r, 16, 120.0) for r in range(16)]
    print(f"16 ranks started, all-reduced and joined in {elapsed:.2f}s")


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

"""--offload without ranks: HostAdamW against torch's fused AdamW (an independent definition of the update), the
memory split and the step-time model (properties), the planner proposing offload only where nothing fits without,
and every refusal in one line before any rank starts."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import cli_here
from tessera.models import get_preset
from tessera.models.spec import shape_of
from tessera.parallel.offload import HostAdamW
from tessera.topology import Layout
from tessera.topology.errors import PlanError
from tessera.topology.memory import RECIPES, model_state_bytes, offload_split
from tessera.topology.estimators.offload_model import gathers_per_step, offload_seconds
from tessera.topology.estimators.planner import Candidate, Hardware, estimate, plan
from tessera.topology.estimators.scoring import estimate_record, score_one

GB = 10**9


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    a = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(3))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return a, b, torch.optim.AdamW(a, fused=True, **kw), HostAdamW(b, **kw)


def _step(params, optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()
    optimizer.zero_grad()


def test_host_adamw_is_fused_adamw_bitwise_and_keeps_its_state_on_host_copies():
    a, b, reference, host = _pair()
    for s in range(4):
        _step(a, reference, s)
        _step(b, host, s)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for x, p in zip(a, b):  # the moments are the host's tensors, not the parameter's storage
        state = host.state[p]
        assert torch.equal(state["exp_avg"], reference.state[x]["exp_avg"])
        assert state["exp_avg"].data_ptr() != p.data_ptr() and state["step"].device.type == "cpu"
    assert host.host_bytes() == sum(16 * p.numel() + 4 for p in b)  # master, gradient, two moments; step count


def test_a_shard_written_by_anything_else_is_copied_down_again_before_the_next_step():
    """A checkpoint load writes the parameters in place: the host master must follow (the version counter)."""
    a, b, reference, host = _pair()
    _step(a, reference, 0)
    _step(b, host, 0)
    with torch.no_grad():
        for x, y in zip(a, b):
            x.mul_(0.5)
            y.mul_(0.5)
    _step(a, reference, 1)
    _step(b, host, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("direction", ["host->plain", "plain->host"])
def test_optimizer_state_moves_between_host_and_plain_adamw(direction):
    a, b, reference, host = _pair()
    source, target = (host, reference) if direction == "host->plain" else (reference, host)
    src_params = b if source is host else a
    dst_params = a if source is host else b
    _step(src_params, source, 0)
    with torch.no_grad():
        for s, d in zip(src_params, dst_params):
            d.copy_(s)
    target.load_state_dict(copy.deepcopy(source.state_dict()))  # as a checkpoint would: no shared tensors
    for p in dst_params:
        assert all(v.device.type == "cpu" for v in target.state[p].values())
    _step(src_params, source, 1)
    _step(dst_params, target, 1)
    assert all(torch.equal(s, d) for s, d in zip(src_params, dst_params))


def test_host_adamw_refuses_a_closure():
    _, b, _, host = _pair()
    with pytest.raises(ValueError, match="no closure"):
        host.step(lambda: 0.0)


@settings(max_examples=60, deadline=None)
@given(
    params=st.floats(1e6, 1e12),
    dp=st.sampled_from([1, 2, 8, 64]),
    stage=st.integers(0, 3),
    recipe=st.sampled_from(sorted(RECIPES)),
)
def test_offload_split_moves_states_and_adds_only_the_host_copies(params, dp, stage, recipe):
    states = model_state_bytes(params, dp=dp, zero_stage=stage, recipe=recipe)
    r = RECIPES[recipe]
    everything = offload_split(states, "params", recipe)
    assert everything["device"]["total"] == 0 and math.isclose(everything["host"]["total"], states["total"])
    moments = offload_split(states, "optimizer", recipe)
    assert math.isclose(moments["device"]["total"], states["parameters"] + states["gradients"])
    elements = states["optimizer"] / r.optimizer
    master = 0 if r.master else 4 * elements
    want = states["optimizer"] + master + states["gradients"] / r.gradients * 4
    assert math.isclose(moments["host"]["total"], want, rel_tol=1e-12)
    none = offload_split(states, "none", recipe)
    assert none["host"]["total"] == 0 and math.isclose(none["device"]["total"], states["total"])


@settings(max_examples=60, deadline=None)
@given(
    elements=st.floats(1e6, 1e11),
    gpus=st.integers(1, 8),
    compute=st.floats(0.0, 10.0),
    strategy=st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP"]),
    microbatches=st.integers(1, 8),
)
def test_the_offload_step_model_exposes_what_cannot_hide(elements, gpus, compute, strategy, microbatches):
    gathers = gathers_per_step(strategy, False, microbatches)
    optimizer = offload_seconds("optimizer", elements, 51.2e9, 307e9, gpus, gathers, compute)
    params = offload_seconds("params", elements, 51.2e9, 307e9, gpus, gathers, compute)
    assert optimizer["offload_copies"] == optimizer["offload_copies_total"] == 8 * elements / 51.2e9
    assert 0 <= params["offload_copies"] <= params["offload_copies_total"]
    assert math.isclose(params["offload_copies"], max(0.0, params["offload_copies_total"] - compute))
    # the host step is memory-bound and the node's GPUs share the host's bandwidth
    assert math.isclose(optimizer["host_optimizer"], 28 * elements * gpus / 307e9)
    assert offload_seconds("none", elements, 51.2e9, 307e9, gpus, gathers, compute) == {}


def _8b():
    return shape_of(get_preset("8b"))


def test_the_planner_offloads_only_where_nothing_fits_without():
    fits = plan(shape_of(get_preset("1b")), Hardware.from_profile("nvidia-h200", 1), 2048, 8)
    assert all(x.candidate.offload == "none" for x in fits.ranked)
    needs = plan(_8b(), Hardware.from_profile("nvidia-h200", 1), 4096, 4)
    best = needs.ranked[0]
    assert best.candidate.offload == "optimizer"  # the cheaper mode first: params copies more
    assert "--offload optimizer" in best.candidate.flags()
    assert needs.why.startswith("no layout fits in 150.1 GB without offload: offload=optimizer moves ")
    assert best.time["host_optimizer"] > 0 and "optimizer" not in best.time
    assert best.memory["optimizer"] == 0 and best.memory["host_offload"] > 100 * GB


def test_a_host_too_small_for_the_offloaded_states_does_not_fit_and_says_so():
    hw = Hardware.from_profile("nvidia-h200", 1, host_memory_gb=64.0)
    x = score_one(_8b(), hw, 4096, 4, Layout(), offload="optimizer", ac="full", microbatches=4)
    assert not x.fits and x.memory["total"] <= hw.usable_bytes
    record = estimate_record(x, hw, _8b(), 4096, 4)
    assert record["host_memory_gb"]["node_has"] == 64.0
    assert record["overflow"].startswith("the offloaded states need 128.5 GB of host memory a node")
    with pytest.raises(PlanError, match="with offload=optimizer or offload=params neither fits either"):
        plan(_8b(), hw, 4096, 4)


def test_params_offload_leaves_the_gpu_no_states_and_hides_its_copies_behind_compute():
    hw = Hardware.from_profile("h100-sxm-80gb", 8)
    cand = Candidate(Layout(dp_shard=8), "FULL_SHARD", "full", "1f1b", 1, offload="params")
    x = estimate(_8b(), cand, hw, 8192, 16)
    assert x.memory["parameters"] == x.memory["gradients"] == x.memory["optimizer"] == 0
    assert x.time["offload_copies"] == 0.0  # 1 GB a rank twice over PCIe, under seconds of compute


def test_train_refuses_what_offload_cannot_run_in_one_line():
    cases = {
        ("--offload", "host"): "--offload 'host' is not one of none, optimizer, params",
        ("--offload", "optimizer", "--optimizer", "muon"): "--offload optimizer with --optimizer muon",
        ("--offload", "optimizer", "--fp8", "tensorwise"): "--offload optimizer with --fp8 tensorwise",
    }
    for flags, message in cases.items():
        out = cli_here("train", "--model", "debug", "--steps", "1", *flags)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr


def test_offloaded_states_that_this_host_cannot_hold_are_refused_with_the_estimate():
    out = cli_here("train", "--model", "8b", "--steps", "1", "--offload", "optimizer")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "and 128.48 GB per rank of offloaded states in host memory" in lines[0]


def test_memory_and_plan_print_where_the_states_go():
    text = cli_here("memory", "--params", "8e9", "--recipe", "fp32_adam", "--offload", "optimizer").stdout
    assert "ZeRO-3 64.00 GB GPU + 128.00 GB host" in text
    rows = json.loads(cli_here("memory", "--params", "8e9", "--dp", "8", "--offload", "params", "--json").stdout)
    assert rows["offload"]["zero3"]["device"]["total"] == 0 and rows["offload"]["zero3"]["host"]["total"] == 16e9
    out = cli_here(
        "plan", "--model", "8b", "--gpus", "1", "--hardware", "nvidia-h200", "--seq-len", "4096",
        "--global-batch", "4", "--layout", "one", "--top", "0", "--offload", "params", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    estimate_ = json.loads(out.stdout)["layout"]["estimate"]
    assert estimate_["host_memory_gb"]["per_node"] == pytest.approx(128.5, abs=0.1)
    assert {"offload_copies", "host_optimizer"} <= set(estimate_["split_s"])


def test_plan_says_why_it_offloads_in_the_command_lines_words():
    out = cli_here(
        "plan", "--model", "8b", "--gpus", "1", "--hardware", "nvidia-h200", "--seq-len", "4096", "--global-batch", "4",
        "--top", "1",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "why: no layout fits in 150.1 GB without offload: --offload optimizer moves 128.5 GB" in out.stdout
    assert "--offload optimizer" in next(ln for ln in out.stdout.splitlines() if ln.startswith("best: "))

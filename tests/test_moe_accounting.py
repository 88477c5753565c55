"""Accounting for mixture of experts (issue 23): the communication counters, the analytic volumes, the
parameter shapes the memory model counts and the planner's layouts know experts and expert parallelism.

    counted   parallel/comm_stats.py: an all-to-all's bytes are exactly the rows a rank sends to the others
    analytic  topology/estimators/comm_model.py: the ep volume for the routing the step measured (routed_fraction),
              and FSDP's (the experts' own unit over edp), tp's, cp's and pp's for MoE layouts, within 2%
              as tests/test_comm_stats.py holds dense layouts
    shapes    topology/shapes.py: every rank's parameters of an MoE model, summed over a layout, are the
              model's (hypothesis); the dry run's fake-backend count is fully_shard's
    planner   offers ep > 1 for an MoE model (its flags round-trip), never for a dense one
"""

from __future__ import annotations

import functools
import json
import shlex
from unittest import mock

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import small_config, cli_here
from shared_spawns import SharedSpawns, selected_keys
from tessera.topology import Layout, axes
from tessera.topology.estimators import comm_model
from tessera.topology.estimators.comm_model import balanced_routed_fraction, comm_bytes_per_step, routed_fraction_of
from tessera.topology.shapes import (
    ModelShape,
    expert_param_shapes,
    fsdp_shard_numel,
    layer_param_shapes,
    layer_shard_groups,
    stage_param_shapes,
)

MOE = dict(model="qwen3-moe-debug", global_batch=8, comm_stats="every", steps=1)


# ----------------------------------------------------------------------------- one counted step
def counted_step_with_routing(config):
    """(bytes counted by axis, analytic with balanced routing, analytic with the routing this rank's
    dispatches measured, those dispatches' (sent, received, rows, recomputed)) of one training step."""
    import torch

    from tessera.models.moe import moe_blocks
    from tessera.parallel.expert import AllToAllDispatch
    from tessera.trainer import Trainer

    trainer = Trainer(config)
    calls: list[tuple[int, int, int, bool]] = []
    for part in trainer.parts:
        for _, block in moe_blocks(part):
            dispatch = block.experts.dispatch
            if isinstance(dispatch, AllToAllDispatch):  # every call's rows, activation checkpointing's reruns too

                def logged(x, counts, run_experts, forward=dispatch.forward, d=dispatch):
                    out = forward(x, counts, run_experts)
                    calls.append((d.sent, d.received, x.shape[0], torch._C._current_graph_task_id() != -1))
                    return out

                dispatch.forward = logged
    comm = trainer.train_step().comm
    balanced = comm["analytic_bytes_by_axis"]
    # the trainer's own analytic call (the run's arguments), given the routing measured
    measured = functools.partial(comm_model.comm_bytes_per_step, routed_fraction=routed_fraction_of(calls))
    with mock.patch.object(comm_model, "comm_bytes_per_step", measured):
        exact = trainer.analytic_comm()
    return comm["bytes_by_axis"], balanced, exact, calls


LAYOUTS = {
    "dp2 x ep2": dict(dp=2, ep=2),
    "dp2 x tp2 x ep2 + sp, ac full": dict(dp=2, tp=2, ep=2, sequence_parallel=True, ac="full"),
    "dp4 x ep2, ac selective": dict(dp=4, ep=2, ac="selective"),  # the experts FSDP-sharded over edp = 2
    "hsdp 2 x 2 x ep2": dict(dp=4, dp_replicate=2, ep=2),  # the experts' gradients all-reduced over dp_replicate
    "cp2 x ep2": dict(cp=2, ep=2),  # ep borrows the cp ranks; the aux loss's counts summed over cp
    "pp2 x dp2 x ep2": dict(pp=2, dp=2, ep=2, microbatches=2),  # FSDP gathers once a step inside a pipeline
    # DeepSeek-V3's recipe: a shared expert beside the routed ones (tp: a dense MLP's input and output more)
    "shared: dp2 x tp2 x ep2 + sp, ac full": dict(
        model="qwen3-moe-shared-debug", dp=2, tp=2, ep=2, sequence_parallel=True, ac="full"
    ),
    "shared: dp2 x tp2 x ep2": dict(model="qwen3-moe-shared-debug", dp=2, tp=2, ep=2),
}


def spawned_rows(session: pytest.Session) -> SharedSpawns:
    """Every rank's counted step of each selected layout, one spawn per world size (tests/shared_spawns.py)."""
    rows = {}
    for case, layout in LAYOUTS.items():
        config = small_config(**{**MOE, **layout})
        rows[("test_an_moe_step_moves_the_analytic_bytes_on_every_axis", case)] = (
            counted_step_with_routing,
            config.layout.world_size,
            (config,),
        )
    return SharedSpawns(rows, selected_keys(session, sys.modules[__name__]), every_rank=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_an_moe_step_moves_the_analytic_bytes_on_every_axis(runs, case):
    config = small_config(**{**MOE, **LAYOUTS[case]})
    results = runs.result(("test_an_moe_step_moves_the_analytic_bytes_on_every_axis", case))
    for rank, (counted, balanced, exact, calls) in enumerate(results):
        total = sum(counted.values())
        assert len(calls) >= config.model_config.n_layers  # every MoE block dispatched by all-to-all
        for axis in axes.COMM_AXES:  # ep: the volume of the routing measured; the others need no routing
            want, got = exact[axis], counted.get(axis, 0.0)
            if want:
                assert abs(got - want) <= 0.02 * want, (
                    f"{case} rank {rank} {axis}: counted {got:.0f} B, analytic {want:.0f} B"
                )
            else:  # only scalars (loss, grad-norm partials) may travel over an axis the model says is silent
                assert got <= 1e-3 * total, f"{case} rank {rank} {axis}: {got:.0f} B counted, none predicted"
            if axis != "ep":
                assert balanced[axis] == want
        assert counted["ep"] > 0 and counted.get("world", 0.0) <= 1e-3 * total
        # tighter than the 2%: the all-to-alls are counted row by row and the volume is exact for the
        # routing measured, while balanced routing's expectation is itself 1-2% off at this size (which a
        # counter using (ep-1)/ep for all-to-alls would pass at 2%)
        assert abs(counted["ep"] - exact["ep"]) <= 1e-3 * exact["ep"], (case, rank, counted["ep"], exact["ep"])


def test_the_planner_uses_the_balanced_routing_volume():
    """The planner's ep bytes are comm_model's with routed_fraction None, which is (ep-1)/ep; the exact
    volume of another routing scales the dispatch and combine rows by it (the counts all-to-all does not)."""
    from tessera.commands.plan import model_shape
    from tessera.topology.estimators.planner import Candidate, Hardware, estimate

    shape = model_shape("qwen3-moe-debug")
    for layout, sp in ((Layout(dp_shard=2, ep=2), False), (Layout(dp_shard=4, tp=2, ep=4), True)):
        cand = Candidate(layout, sp=sp)
        planned = estimate(shape, cand, Hardware(gpus=layout.world_size, dtype_bytes=4, recipe="fp32_adam"), 32, 8)
        balanced = comm_bytes_per_step(shape, layout, 32, 8, sequence_parallel=sp)
        assert planned.comm_bytes == balanced and balanced["ep"] > 0
        share = balanced_routed_fraction(layout.ep)
        assert comm_bytes_per_step(shape, layout, 32, 8, sequence_parallel=sp, routed_fraction=share) == balanced
        # the dispatch and combine: rows x tokens x top_k assignments of dim fp32 each, 4 a block, forward and back
        moved = 4 * shape.n_layers * (8 // layout.dp) * 32 * shape.top_k * shape.dim * 4
        counts = shape.n_layers * shape.n_experts * 8 * share
        nothing_off = comm_bytes_per_step(shape, layout, 32, 8, sequence_parallel=sp, routed_fraction=0.0)["ep"]
        assert nothing_off == pytest.approx(counts) and balanced["ep"] == pytest.approx(counts + share * moved)


def test_routed_fraction_weighs_each_dispatch_as_often_as_it_runs():
    # 2 ranks, 10 assignments each: this rank sends 6 away and receives 3 (+ the 4 it keeps): moves 6 + 3
    assert routed_fraction_of([(6, 7, 10)]) == pytest.approx(9 / 20)
    # a recompute moves its rows forward only: weighed once against the original's twice
    assert routed_fraction_of([(6, 7, 10), (0, 10, 10, True)]) == pytest.approx((2 * 9 + 0) / (2 * 20 + 20))
    with pytest.raises(ValueError, match="no assignments"):
        routed_fraction_of([])
    with pytest.raises(ValueError, match=r"routed_fraction=1.5 .* in \[0, 1\]"):
        comm_bytes_per_step(
            ModelShape(8, 1, 2, 2, 4, 16, 8, n_experts=4, top_k=1), Layout(dp_shard=2, ep=2), 8, 2, routed_fraction=1.5
        )


# ----------------------------------------------------------------------------- the counters
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(0, 5), st.data())
def test_an_all_to_all_counts_the_rows_sent_to_the_other_ranks(n, cols, data):
    import torch

    from tessera.parallel.comm_stats import _sent_to_others

    splits = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    me = data.draw(st.integers(0, n - 1))
    x = torch.zeros(sum(splits), cols + 1, dtype=torch.bfloat16)
    sent = _sent_to_others(x, splits, n, me)
    assert sent == sum(s for i, s in enumerate(splits) if i != me) * (cols + 1) * 2
    equal = torch.zeros(n * 3, cols + 1)  # no splits given: n equal chunks
    assert _sent_to_others(equal, [], n, me) == (n - 1) * 3 * (cols + 1) * 4


def test_the_experts_fsdp_group_is_every_ep_th_rank_of_dp_shard_x_cp():
    from tessera.parallel.comm_stats import expert_shard_group

    layout = Layout(dp_shard=4, cp=2, tp=2, ep=4)  # dp_shard x cp = 8 flattened ranks: edp 2 x ep 4
    for rank in range(layout.world_size):
        shard = layout.group(("dp_shard", "cp"), rank)
        group = expert_shard_group(layout, rank)
        assert len(group) == 2 and rank in group and set(group) <= set(shard)
        i = shard.index(rank)  # the flattened index: edp = i // ep, ep = i % ep (topology/mesh.py)
        assert [shard.index(r) % 4 for r in group] == [i % 4] * 2


# ----------------------------------------------------------------------------- shapes
@st.composite
def moe_shapes(draw) -> ModelShape:
    kv = draw(st.integers(1, 3))
    experts = draw(st.sampled_from([1, 2, 4, 8, 16]))
    return ModelShape(
        dim=draw(st.integers(1, 24)),
        n_layers=draw(st.integers(1, 5)),
        n_heads=kv * draw(st.integers(1, 3)),
        n_kv_heads=kv,
        head_dim=2 * draw(st.integers(1, 6)),
        vocab_size=draw(st.integers(1, 300)),
        ffn_dim=draw(st.integers(1, 24)),
        norm=draw(st.sampled_from(["rms", "layer"])),
        qk_norm=draw(st.booleans()),
        tied_embeddings=draw(st.booleans()),
        bias=draw(st.booleans()),
        n_experts=experts,
        top_k=draw(st.integers(1, experts)),
        shared_ffn_dim=draw(st.sampled_from([0, 0, 3, 8])),
    )


@settings(max_examples=300, deadline=None)
@given(moe_shapes(), st.data())
def test_every_ranks_moe_parameters_add_up_to_the_model(shape, data):
    """Over a layout's ranks (pp stages x tp x the FSDP shards of dp_shard x cp, the experts split over ep
    and their shards over edp), the per-rank parameters sum to the model's, plus what tp replicates and a
    later last stage's copy of a tied embedding."""
    tp = data.draw(st.sampled_from([1, 2, 4]))
    ep = data.draw(st.sampled_from([e for e in (1, 2, 4, 8) if shape.n_experts % e == 0]))
    shards = ep * data.draw(st.integers(1, 3))  # dp_shard x cp: ep borrows ep of them
    n_stages = data.draw(st.integers(1, shape.n_layers))
    # tp dividing the heads, kv heads, widths and the vocabulary (no torch.chunk padding)
    shape = ModelShape(
        **{
            **shape.__dict__,
            **{k: getattr(shape, k) * tp for k in ("n_heads", "n_kv_heads", "ffn_dim", "shared_ffn_dim", "vocab_size")},
        }
    )
    layers = comm_model.stage_layer_counts(shape.n_layers, n_stages)
    held = 0
    for s in range(n_stages):
        extra = stage_param_shapes(shape, tp, s == 0, s == n_stages - 1, 0, ep)
        for i in range(shards):  # the rank at flattened index i of dp_shard x cp: edp index i // ep
            held += tp * sum(fsdp_shard_numel(r, c, shards, i) for u in extra for r, c in u)
            for shapes, n in layer_shard_groups(shape, tp, ep, shards):
                held += tp * layers[s] * sum(fsdp_shard_numel(r, c, n, i // (shards // n)) for r, c in shapes)
    # what each tp rank holds whole: the norms, qk-norms, o's bias and the router of a block, the final norm
    replicated = 2 * shape.norm_params + (2 * shape.head_dim if shape.qk_norm else 0) + (shape.dim if shape.bias else 0)
    replicated += shape.n_experts * shape.dim
    copy = shape.vocab_size * shape.dim if shape.tied_embeddings and n_stages > 1 else 0
    assert held == shape.num_params() + copy + (tp - 1) * (shape.n_layers * replicated + shape.norm_params)
    # ep divides the experts among its ranks: E / ep of every matrix on each, the rest of the block whole
    one = sum(r * c for r, c in expert_param_shapes(shape, tp, ep))
    assert ep * tp * one == shape.n_experts * shape.mlp_matrices * shape.dim * shape.ffn_dim
    assert sum(r * c for r, c in layer_param_shapes(shape, 1)) == shape.block_params()


def test_moe_presets_count_what_their_modules_hold():
    """ModelShape's closed-form counts against the modules built on meta (a shared expert's config too), and
    the active parameters: top_k experts of each block, the router and the attention whole."""
    import dataclasses

    from tessera.models import build_model, get_preset
    from tessera.commands.plan import model_shape

    configs = [get_preset(n) for n in ("qwen3-moe-debug", "qwen3-moe-shared-debug", "qwen3-30b-a3b")]
    configs.append(dataclasses.replace(configs[0], shared_ffn_dim=24, tie_word_embeddings=True))
    for cfg in configs:
        model = build_model(cfg, device="meta")
        shape = model_shape(cfg)
        assert sum(p.numel() for p in model.parameters()) == shape.num_params()
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert experts == shape.expert_params()
        embedding = 0 if shape.tied_embeddings else shape.vocab_size * shape.dim  # a lookup (the tied one is the head)
        assert (
            shape.matmul_params() == shape.num_params() - experts + experts * shape.top_k // shape.n_experts - embedding
        )
    with pytest.raises(ValueError, match="top_k 9 must be between 1 and n_experts=8"):
        ModelShape(8, 1, 2, 2, 4, 16, 8, n_experts=8, top_k=9)
    with pytest.raises(ValueError, match="ep=3 does not divide the 8 experts"):
        expert_param_shapes(ModelShape(8, 1, 2, 2, 4, 16, 8, n_experts=8, top_k=2), 1, 3)


def test_the_dry_runs_expert_count_is_fully_shards():
    """dry_run_model_states counts the experts' FSDP2 shards over edp by the torch.chunk rule; fully_shard
    on the fake backend, with expert parallel applied, leaves the same on every rank checked."""
    from torch.distributed.tensor import DTensor

    from tessera.models import build_model, get_preset
    from tessera.parallel.fsdp import DataParallelConfig, apply_fsdp
    from tessera.parallel.expert import apply_ep
    from tessera.parallel.parallelize import dry_run_model_states
    from tessera.parallel.tp_plan import apply_tp
    from tessera.topology import Meshes, dry_run

    for layout in (
        Layout(dp_shard=8, ep=4),
        Layout(dp_shard=3, cp=2, tp=2, ep=2),
        Layout(dp_replicate=2, dp_shard=4, tp=2, ep=2),
    ):
        for rank in range(0, layout.world_size, 5):
            counted = dry_run_model_states("qwen3-moe-debug", layout, rank=rank)["local_params"]
            with dry_run(layout, rank=rank) as mesh:
                meshes = Meshes(layout, "cpu", mesh=mesh)
                model = build_model(get_preset("qwen3-moe-debug"), device="meta")
                if meshes.tp is not None:
                    apply_tp(model, meshes.tp)
                apply_ep(model, meshes.ep, meshes.tp)
                apply_fsdp(model, meshes.fsdp, DataParallelConfig(), expert_mesh=meshes.expert_fsdp)
                real = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
            assert counted == real, (layout, rank)


# ----------------------------------------------------------------------------- the planner
@pytest.fixture(scope="module")
def moe_plan():
    from tessera.commands.plan import model_shape
    from tessera.topology.estimators.planner import Hardware, plan

    return plan(model_shape("qwen3-30b-a3b"), Hardware(gpus=64), 4096, 256)


def test_the_planner_offers_expert_parallel_for_an_moe_model(moe_plan):
    """ep > 1 layouts are enumerated, fit and are ranked with their all-to-all time exposed, their flags
    giving back their layout; the best of them is the plan's `best_ep`."""
    ranked = moe_plan.ranked
    with_ep = [x for x in ranked if x.candidate.layout.ep > 1]
    assert {x.candidate.layout.ep for x in with_ep} >= {2, 4, 8}
    place, best_ep = moe_plan.best_ep
    assert best_ep is with_ep[0] and ranked[place - 1] is best_ep
    for x in with_ep[::97] + [best_ep]:
        lay = x.candidate.layout
        assert x.time["ep"] > 0 and x.comm_bytes["ep"] > 0 and lay.dp_shard * lay.cp % lay.ep == 0
        words = shlex.split(x.candidate.flags())
        given = {
            w[2:].replace("-", "_"): int(v)
            for w, v in zip(words, words[1:] + [""])
            if w[2:].replace("-", "_") in axes.FLAGS
        }
        assert Layout(**axes.degrees_from_flags(given)) == lay and f"--ep {lay.ep}" in x.candidate.flags()
    # MFU counts the active parameters (3B of 30B): 6 per token and parameter, plus causal attention
    from tessera.commands.plan import model_shape

    cfg, request, best = model_shape("qwen3-30b-a3b"), moe_plan.request, ranked[0]
    assert request["matmul_params"] == cfg.matmul_params() < request["params"] / 5
    flops = (6 * request["matmul_params"] + 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 4096) * 256 * 4096
    assert best.mfu == pytest.approx(flops / (best.time["step"] * 64 * request["hardware"]["peak_tflops"] * 1e12))


def test_tessera_plan_prints_the_best_expert_parallel_layout_and_its_flags():
    out = cli_here(
        "plan", "--model", "qwen3-30b-a3b", "--gpus", "64", "--seq-len", "4096", "--global-batch", "256", "--top", "1",
        "--hbm-gbps", "3000",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    best = next(ln for ln in lines if ln.startswith("best: "))
    # the best layout uses expert parallel, or the best that does is printed beside it with its flags
    line = best if " --ep " in best else next(ln for ln in lines if ln.startswith("best with expert parallel (ranked "))
    assert " --ep " in line and "experts streamed at 3000 GB/s" in out.stdout


def test_the_planner_never_offers_expert_parallel_for_a_dense_model():
    from tessera.commands.plan import model_shape
    from tessera.topology.estimators.planner import Candidate, Hardware, candidates, why_not_runnable

    for model in ("8b", "qwen3-0.6b"):
        found = candidates(model_shape(model), Hardware(gpus=16), 4096, 64)
        assert found and {c.layout.ep for c in found} == {1}
    reason = why_not_runnable(model_shape("8b"), Candidate(Layout(dp_shard=4, ep=2)), 4096, 8)
    assert reason == (
        "ep=2 needs a mixture-of-experts model (llama has no experts); use ep 1, or a model with experts such as "
        "qwen3-moe-debug"
    )


def test_expert_parallel_shrinks_a_ranks_parameters_and_the_memory_model_agrees():
    from tessera.commands.plan import model_shape
    from tessera.topology.memory import model_state_bytes
    from tessera.topology.estimators.rank_memory import rank_params

    shape = model_shape("qwen3-30b-a3b")
    numel = {ep: rank_params(shape, 1, 1, 1, 8, ep)[0] for ep in (1, 2, 8)}
    assert numel[1] == shape.num_params()
    assert numel[8] == shape.num_params() - shape.expert_params() * 7 // 8
    # ZeRO-3 over 8 ranks: ep changes nothing; ZeRO-1 (parameters whole): the experts split over ep
    for stage in (1, 3):
        even = model_state_bytes(shape.num_params(), dp=8, zero_stage=stage)
        ep8 = model_state_bytes(shape.num_params(), dp=8, zero_stage=stage, ep=8, expert_params=shape.expert_params())
        if stage == 3:
            assert ep8["total"] == pytest.approx(even["total"])
        else:
            assert ep8["parameters"] == pytest.approx(numel[8] * 2)
    with pytest.raises(ValueError, match="ep=3 must divide the 8 ranks"):
        model_state_bytes(1e9, dp=8, zero_stage=3, ep=3, expert_params=1e8)


# ----------------------------------------------------------------------------- another framework's expert group
@settings(max_examples=40, deadline=None)
@given(st.sampled_from([2, 4, 8]), st.sampled_from([2, 4]), st.sampled_from([0.25, 0.5, 1.0]))
def test_an_expert_group_over_tp_moves_a_tp_th_of_the_rows_over_ep_x_tp_ranks(ep, tp, routed):
    """`ep_over_tp` (tessera plan's Megatron folding): each rank dispatches its own sequence shard, so a
    dispatch's rows are 1/tp of the tp-sharded experts' at the same routed share, the counts all-to-all spans
    ep x tp ranks, and the MoE block's tp gathers are not issued (the router's gradient still is)."""
    from tessera.commands.plan import model_shape

    cfg = model_shape("qwen3-moe-debug")
    lay = Layout(dp_shard=ep, tp=tp, ep=ep)
    kw = dict(microbatches=2, sequence_parallel=True, routed_fraction=routed)
    plain = comm_bytes_per_step(cfg, lay, 64, 2 * ep, **kw)
    folded = comm_bytes_per_step(cfg, lay, 64, 2 * ep, ep_over_tp=True, **kw)
    counts = lambda n: 2 * cfg.n_layers * comm_model.wire_bytes("all_to_all", cfg.n_experts * 8, n)  # noqa: E731
    assert folded["ep"] - counts(ep * tp) == pytest.approx((plain["ep"] - counts(ep)) / tp)
    assert folded["tp"] < plain["tp"]
    for name in ("cp", "pp", "dp_shard_cp", "dp_replicate"):
        assert folded[name] == plain[name]


@pytest.mark.parametrize(
    "layout, sp",
    [(Layout(dp_shard=4, ep=4), True), (Layout(dp_shard=2, tp=2), True), (Layout(dp_shard=2, tp=2, ep=2), False)],
)
def test_an_expert_group_over_tp_needs_ep_tp_and_sequence_parallel(layout, sp):
    from tessera.commands.plan import model_shape

    cfg = model_shape("qwen3-moe-debug")
    with pytest.raises(ValueError, match="ep_over_tp=True folds tp into the expert group"):
        comm_bytes_per_step(cfg, layout, 64, 8, sequence_parallel=sp, ep_over_tp=True)


def test_tessera_plan_scores_an_expert_group_over_tp_as_asked():
    """`+ep_over_tp` is recorded in the request and halves a tp 2 layout's expert bytes: each rank sends its
    own sequence shard over an ep x tp group (balanced routing: (16-1)/16 of it against (8-1)/8)."""
    got = {}
    for option in ("", "+ep_over_tp"):
        out = cli_here(
            "plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--seq-len", "4096", "--global-batch", "64",
            "--layout", f"dp8xtp2xep8+sp{option}", "--top", "0", "--json",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        got[option] = json.loads(out.stdout)
    assert got["+ep_over_tp"]["request"]["ep_over_tp"] and not got[""]["request"]["ep_over_tp"]
    plain, folded = (got[o]["layout"]["estimate"] for o in ("", "+ep_over_tp"))
    ratio = folded["comm_bytes"]["ep"] / plain["comm_bytes"]["ep"]
    assert ratio == pytest.approx(0.5 * (15 / 16) / (7 / 8), rel=0.01)
    assert folded["split_s"]["ep"] < plain["split_s"]["ep"]

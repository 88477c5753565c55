"""The users' property-testing API on a model that is not tessera's: a sharding plan, the equivalence
runner, the invariant checks, and planted bugs that each check must catch by name."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import find, given, settings
from hypothesis import strategies as st
from torch import nn

from tessera.parallel.invariants import (
    InvariantError,
    check_fsdp_resharded,
    check_fsdp_unshard,
    check_reduce_scatter_all_gather,
    check_ring_merge,
    check_schedule_sound,
    check_shard_gather,
    check_state_preserved,
)
from tessera.launching.launch import RankFailure, run_ranks
from tessera.parallel.tp_plan import ColwiseParallel, Plan, ReplicatedNorm, RowwiseParallel
from tessera.testing import LayoutsDiverge, assert_layouts_equivalent
from tessera.topology import Layout
from tessera.topology.strategies import divisible_shapes, layouts, placements, schedules


# ----------------------------------------------------------------------------- a user's model, its own names
class Mixer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.head_dim = dim // heads
        self.pre = nn.LayerNorm(dim)
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.mix = nn.Linear(dim, dim)
        self.post = nn.RMSNorm(dim, eps=1e-6)
        self.expand, self.contract = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        B, S, _ = x.shape
        h = self.pre(x)
        q, k, v = (f(h).view(B, S, -1, self.head_dim).transpose(1, 2) for f in (self.query, self.key, self.value))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, -1)
        x = x + self.mix(a)
        return x + self.contract(F.gelu(self.expand(self.post(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=32, dim=32, heads=4, hidden=64, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mixers = nn.ModuleList(Mixer(dim, heads, hidden) for _ in range(depth))
        self.readout = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for m in self.mixers:
            x = m(x)
        return self.readout(x)


def build_tiny_lm():
    return TinyLM()


PLAN = Plan(
    {
        "mixers.*.pre": ReplicatedNorm(),
        "mixers.*.post": ReplicatedNorm(),
        "mixers.*.query": ColwiseParallel(),
        "mixers.*.key": ColwiseParallel(),
        "mixers.*.value": ColwiseParallel(),
        "mixers.*.mix": RowwiseParallel(),
        "mixers.*.expand": ColwiseParallel(),
        "mixers.*.contract": RowwiseParallel(),
    },
    blocks=["mixers.*"],
    checkpoint_blocks="mixers.*",
)


def batch(rows=4, seq=8, vocab=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_a_user_model_trains_equivalently_on_tp2_dp2_and_dp2xtp2():
    assert_layouts_equivalent(
        build_tiny_lm,
        [Layout(tp=2), Layout(dp_shard=2), Layout(dp_shard=2, tp=2)],
        batch(),
        steps=2,
        rtol=1e-5,
        plan=PLAN,
    )


def test_the_plan_keeps_names_and_shards_what_it_names():
    """tp2 on a fake mesh: the planned linears hold half their rows or columns, everything keeps its name."""
    from tessera.parallel import ParallelConfig, parallelize
    from tessera.topology import dry_run

    model = build_tiny_lm()
    names = [n for n, _ in model.named_parameters()]
    with dry_run(Layout(tp=2)) as mesh:
        parallelize(model, mesh, ParallelConfig(Layout(tp=2)), plan=PLAN)
        local = {n: getattr(p, "to_local", lambda p=p: p)().shape for n, p in model.named_parameters()}
    assert list(local) == names
    assert local["mixers.0.query.weight"] == (16, 32) and local["mixers.0.query.bias"] == (16,)
    assert local["mixers.0.mix.weight"] == (32, 16) and local["mixers.0.mix.bias"] == (32,)
    assert local["embed.weight"] == (32, 32)  # not in the plan: replicated


def test_a_plan_rule_that_matches_nothing_or_the_wrong_kind_is_a_clear_error():
    from tessera.parallel import ParallelConfig, parallelize
    from tessera.topology import dry_run

    with dry_run(Layout(tp=2)) as mesh:
        with pytest.raises(ValueError, match=r"plan rule 'mixers\.\*\.qkv' matches no module of TinyLM"):
            parallelize(
                build_tiny_lm(), mesh, ParallelConfig(Layout(tp=2)), plan=Plan({"mixers.*.qkv": ColwiseParallel()})
            )
        with pytest.raises(ValueError, match=r"ColwiseParallel on 'mixers.0.pre' needs a Linear, got LayerNorm"):
            parallelize(
                build_tiny_lm(), mesh, ParallelConfig(Layout(tp=2)), plan=Plan({"mixers.*.pre": ColwiseParallel()})
            )
    with pytest.raises(ValueError, match="a plan without a model spec supports dp .* and tp only: pp=2"):
        with dry_run(Layout(pp=2)) as mesh:
            parallelize(build_tiny_lm(), mesh, ParallelConfig(Layout(pp=2)), plan=PLAN)


def test_tesseras_llama_goes_through_the_same_plan_mechanism():
    from tessera.models import build_model, get_preset, spec_of
    from tessera.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    from tessera.parallel.tp_plan import apply_tp, spec_plan
    from tessera.topology import dry_run

    cfg = get_preset("debug")
    plan = spec_plan(spec_of(cfg), spec_of(cfg).shape(cfg), 2)
    assert {"layers.*.attention.wq", "layers.*.feed_forward.w2", "output", "tok_embeddings"} <= set(plan.rules)
    with dry_run(Layout(tp=2)) as mesh:
        model = apply_tp(build_model(cfg, device="meta"), mesh["tp"])
    assert isinstance(model.layers["0"].attention.wq, ColumnParallelLinear)
    assert isinstance(model.layers["1"].feed_forward.w2, RowParallelLinear)


# ----------------------------------------------------------------------------- planted bugs in layers
class RowwiseSkippingForwardReduce(RowwiseParallel):
    def apply(self, module, tp_mesh, sequence_parallel):
        layer = super().apply(module, tp_mesh, sequence_parallel)
        layer.forward = lambda x: F.linear(x, layer.weight.to_local()) + layer.bias.to_local()
        return layer


class ColwiseSkippingBackwardReduce(ColwiseParallel):
    def apply(self, module, tp_mesh, sequence_parallel):
        from tessera.parallel.tensor import ColumnParallelLinear

        return ColumnParallelLinear(module.weight, tp_mesh, None, module.bias)  # no copy_to_tp: no all-reduce of dx


def _planted(style_name, style):
    return Plan({**PLAN.rules, style_name: style}, blocks=PLAN.blocks)


def test_a_row_parallel_layer_that_skips_its_forward_all_reduce_is_named():
    with pytest.raises(LayoutsDiverge, match=r"layout tp2, step 1: gradient of parameter '[\w.]+' differs"):
        assert_layouts_equivalent(
            build_tiny_lm,
            [Layout(tp=2)],
            batch(),
            steps=1,
            plan=_planted("mixers.*.contract", RowwiseSkippingForwardReduce()),
        )


def test_a_column_parallel_layer_that_skips_its_backward_all_reduce_is_named():
    with pytest.raises(LayoutsDiverge) as e:
        assert_layouts_equivalent(
            build_tiny_lm,
            [Layout(tp=2)],
            batch(),
            steps=1,
            plan=_planted("mixers.*.expand", ColwiseSkippingBackwardReduce()),
        )
    # the forward is exact (losses agree); the input gradient misses the other rank's half
    assert "layout tp2, step 1: gradient of parameter 'embed.weight' differs" in str(e.value)
    assert "; loss" not in str(e.value)


# ----------------------------------------------------------------------------- invariants on ranks
def _placements_property(world):
    from tessera.topology import Layout

    mesh = Layout(dp_shard=2, tp=world // 2).build_mesh("cpu")["dp_shard", "tp"]
    checked = []

    @settings(max_examples=20, derandomize=True, database=None, deadline=None)
    @given(st.data())
    def prop(data):
        shape = data.draw(divisible_shapes([2, 1, 2], max_multiple=3))
        where = data.draw(placements(len(shape), mesh_ndim=2))
        g = torch.Generator().manual_seed(len(checked))
        tensor = torch.randn(shape, generator=g)
        check_shard_gather(tensor, mesh, where, name=f"t{len(checked)}")
        checked.append(where)

    prop()
    group = mesh["tp"].get_group()
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    check_reduce_scatter_all_gather(x, group, name="x")
    try:  # planted: a reduce-scatter that keeps its own piece without summing

        def no_sum(out, inp, g):
            out.copy_(inp.chunk(torch.distributed.get_world_size(g))[torch.distributed.get_rank(g)])

        check_reduce_scatter_all_gather(x, group, name="x", reduce_scatter=no_sum)
        planted = None
    except InvariantError as e:
        planted = str(e)
    return len(checked), planted


def test_shard_then_gather_is_the_identity_for_every_placement_and_rs_ag_is_all_reduce():
    results = run_ranks(_placements_property, 4, 4, timeout=120)
    assert results[0][0] == 20
    assert "reduce-scatter then all-gather differs from all-reduce for x (8, 3) over a group of 2" in results[0][1]


def _fsdp_checks(world):
    from tessera.parallel import ParallelConfig, parallelize

    layout = Layout(dp_shard=2, tp=2)
    torch.manual_seed(0)
    model = build_tiny_lm()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize(model, layout.build_mesh("cpu"), ParallelConfig(layout), plan=PLAN)
    check_fsdp_unshard(model, reference, layout="dp2 x tp2")
    model.mixers[1].set_reshard_after_backward(False)  # planted: this unit stays gathered after backward
    x, y = batch()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    try:
        check_fsdp_resharded(model, layout="dp2 x tp2")
        return None
    except InvariantError as e:
        return str(e)


def test_fsdp_unshard_equals_the_original_and_a_unit_never_resharded_is_named():
    message = run_ranks(_fsdp_checks, 4, 4, timeout=120)[0]
    assert message.startswith("FSDP unit 'mixers.1' was never resharded on dp2 x tp2: parameter 'mixers.1.")


def _checkpoint_across_layouts(path, drop):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from tessera.parallel import ParallelConfig, parallelize

    def built(layout, seed):
        torch.manual_seed(seed)
        m = build_tiny_lm()
        full = {n: t.detach().clone() for n, t in m.state_dict().items()}
        return parallelize(m, layout.build_mesh("cpu"), ParallelConfig(layout), plan=PLAN), full

    saved, expected = built(Layout(dp_shard=4), seed=1)
    dcp.save({"model": get_model_state_dict(saved)}, checkpoint_id=path)
    target, _ = built(Layout(dp_shard=2, tp=2), seed=2)
    state = {"model": get_model_state_dict(target)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(target, state["model"])
    if drop and torch.distributed.get_rank() == 3:  # planted: one rank's shard of one weight never arrives
        with torch.no_grad():
            target.mixers[0].expand.weight.to_local().detach().zero_()
    try:
        check_state_preserved(target, expected, layout="dp2 x tp2 (saved on dp4)")
        return None
    except InvariantError as e:
        return str(e)


def test_a_checkpoint_moves_between_layouts_bitwise_and_a_dropped_shard_is_named(tmp_path):
    assert run_ranks(_checkpoint_across_layouts, 4, str(tmp_path / "ok"), False, timeout=120) == [None] * 4
    messages = run_ranks(_checkpoint_across_layouts, 4, str(tmp_path / "bad"), True, timeout=120)
    assert all(
        m and m.startswith("checkpoint tensor 'mixers.0.expand.weight' was not preserved on dp2 x tp2 (saved on dp4)")
        for m in messages
    )


# ----------------------------------------------------------------------------- pure invariants
def test_ring_merge_equals_the_full_softmax_and_a_wrong_sign_is_caught():
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 4, 12, 8, generator=g),
        torch.randn(1, 2, 12, 8, generator=g),
        torch.randn(1, 2, 12, 8, generator=g),
    )
    for causal in (False, True):
        check_ring_merge(q, k, v, blocks=3, causal=causal)

    def wrong_sign(out, lse, block_out, block_lse):  # logaddexp with the block's lse subtracted
        new = torch.logaddexp(lse, -block_lse)
        keep = torch.exp(lse - new).nan_to_num(0).unsqueeze(-1)
        take = torch.exp(block_lse - new).nan_to_num(0).unsqueeze(-1)
        return out * keep + block_out * take, new

    with pytest.raises(
        InvariantError,
        match=r"merging 3 attention blocks differs from the full softmax for attention \(q \(1, 4, 12, 8\)",
    ):
        check_ring_merge(q, k, v, blocks=3, merge=wrong_sign)


@settings(max_examples=30, deadline=None)
@given(schedules(max_stages=4, max_microbatches=6))
def test_every_built_schedule_is_sound(case):
    check_schedule_sound(case.schedule, name=case.kind)


def test_a_schedule_missing_one_backward_is_named():
    from tessera.topology.schedules.schedule import build_schedule

    schedule = build_schedule("1f1b", stages=2, microbatches=3)
    schedule[1] = [a for a in schedule[1] if not (a.op == "B" and a.microbatch == 2)]
    with pytest.raises(InvariantError, match=r"pipeline 1f1b over 2 ranks is not sound: B2@1 is missing"):
        check_schedule_sound(schedule, name="1f1b")


# ----------------------------------------------------------------------------- strategies
def _fits(layout, cfg, seq_len, global_batch, max_world):
    return (
        layout.world_size <= max_world
        and cfg.n_heads % layout.tp == 0
        and cfg.ffn_dim % layout.tp == 0
        and (cfg.n_kv_heads % layout.tp == 0 or layout.tp % cfg.n_kv_heads == 0)
        and (layout.cp == 1 or seq_len % (2 * layout.cp) == 0)
        and layout.pp <= cfg.n_layers
        and global_batch % layout.dp == 0
    )


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_layout_strategies_never_violate_their_constraints(data):
    from tessera.models import get_preset

    cfg = get_preset("debug")  # 4 heads, 2 kv heads, ffn 192, 2 layers
    max_world = data.draw(st.integers(1, 64))
    seq_len, global_batch = data.draw(st.sampled_from([12, 16, 64])), data.draw(st.sampled_from([6, 8, 12]))
    layout = data.draw(layouts(max_world, axes=Layout.AXES, model=cfg, seq_len=seq_len, global_batch=global_batch))
    assert _fits(layout, cfg, seq_len, global_batch, max_world), layout


def test_a_failing_example_shrinks_to_the_minimal_layout():
    # "fails whenever tp and dp are both used": hypothesis shrinks any such layout to dp2 x tp2
    found = find(
        layouts(16, axes=("dp_shard", "cp", "tp")),
        lambda lay: lay.tp > 1 and lay.dp > 1,
        settings=settings(database=None, max_examples=500),
    )
    assert found == Layout(dp_shard=2, tp=2)


def test_strategies_refuse_unknown_axes():
    with pytest.raises(ValueError, match="unknown axes"):
        find(layouts(4, axes=("dp",)), lambda lay: True)


def test_a_diverging_layout_stops_with_every_input_error_first():
    with pytest.raises(ValueError, match="the batch's 3 rows do not split over dp=2; use a multiple of 2 rows"):
        assert_layouts_equivalent(build_tiny_lm, [Layout(dp_shard=2)], batch(rows=3), plan=PLAN)
    with pytest.raises(
        ValueError, match="pp and cp read a model's stages and attention slots from its spec: pass spec=ModelSpec"
    ):
        assert_layouts_equivalent(build_tiny_lm, [Layout(cp=2)], batch(), plan=PLAN)


def test_a_bad_plan_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="ColwiseParallel on 'embed' needs a Linear, got Embedding"):
        assert_layouts_equivalent(build_tiny_lm, [Layout(tp=2)], batch(), plan=Plan({"embed": ColwiseParallel()}))


def _fails_on_rank_1():
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
        raise RuntimeError("planted failure")
    return build_tiny_lm()


def test_rank_failures_inside_the_runner_are_reported():
    with pytest.raises(RankFailure, match="planted failure"):
        assert_layouts_equivalent(_fails_on_rank_1, [Layout(tp=2)], batch(), plan=PLAN)


def test_a_parallel_config_checks_a_shape_once_and_a_failure_every_time(monkeypatch):
    """The run's check, then parallelize's on every pipeline stage: the checks run once per config and shape
    (a call asking no more than one that passed returns at once); a call that fails fails each time."""
    import importlib

    from tessera.parallel import ParallelConfig
    from tessera.topology.preset_shapes import preset_shape

    composition = importlib.import_module(
        "tessera.parallel.parallelize"
    )  # the module (the package exports the function)
    calls = []
    real = composition.check_context
    monkeypatch.setattr(composition, "check_context", lambda *a: (calls.append(a), real(*a))[1])
    config, shape = ParallelConfig(Layout(dp_shard=2, cp=2)), preset_shape("debug")
    config.check(shape, 64, 8, 1)
    config.check(shape, 64, 8, 1)
    config.check(shape)  # parallelize's, per stage: the shape alone, which the run's check covered
    assert len(calls) == 1
    config.check(shape, 128, 8, 1)  # another sequence: checked
    assert len(calls) == 2
    for _ in range(2):
        with pytest.raises(ValueError, match="63"):
            config.check(shape, 63, 8, 1)  # not divisible by 2 x cp
    assert len(calls) == 4
    assert ParallelConfig(Layout(dp_shard=2, cp=2)) == config  # what passed is no field of the config

"""The axes as data (topology/axes.py): the table is what the layout, the meshes, the command line and the
communication accounting read, and its degree rules accept exactly the layouts the layout and the parallel
layers' checks accept."""

import argparse
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.topology import FLATTENED, Layout, axes
from tessera.topology.axes import AXIS, COMM_AXES, MESH_AXES, STEPS, TABLE, Axis

NAMES = tuple(a.name for a in TABLE)


def test_the_table_names_the_layouts_axes_in_mesh_order():
    assert NAMES == MESH_AXES == Layout.AXES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert [a.dim for a in TABLE] == list(range(len(TABLE)))
    assert tuple(Layout().as_dict()) == NAMES  # one Layout field per entry, in its order
    assert Layout(pp=2, dp_shard=2, cp=2, tp=2).shape == (2, 1, 2, 2, 2)


def test_the_flattened_meshes_and_the_accounting_come_from_the_entries():
    assert FLATTENED == {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
                         "dp_cp": ("dp_replicate", "dp_shard", "cp")}
    assert list(FLATTENED) == ["dp", "dp_shard_cp", "dp_cp"]  # build_mesh flattens in this order
    assert COMM_AXES == ("pp", "dp_replicate", "dp_shard_cp", "cp", "tp")  # topology/comm_model.py's keys
    purposes = {f.purpose: f.name for f in axes.FLATTENED_MESHES}
    assert purposes == {"batch": "dp", "fsdp": "dp_shard_cp", "loss": "dp_cp"}
    assert {a.mesh for a in TABLE if a.mesh} == {"tp", "pp", "cp"}


def test_the_order_of_application_is_tp_cp_ac_compile_fsdp_after_the_pipeline_cut():
    assert STEPS == ("pp", "tp", "cp", "ac", "compile", "fsdp")
    order = {a.name: a.order for a in TABLE}
    assert order["pp"] < order["tp"] < order["cp"] < order["dp_shard"] == order["dp_replicate"]
    assert {s for a in TABLE for s in a.shards} == set(axes.SHARDS)  # every kind of split has its axis


def _train_options() -> dict[str, argparse.Action]:
    from tessera.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {opt: action for action in sub.choices["train"]._actions for opt in action.option_strings}


def test_every_axis_has_its_flag_and_help_in_the_train_command():
    options = _train_options()
    for a in TABLE:
        assert a.option in options, f"{a.name}: no {a.option} in `tessera train`"
        assert options[a.option].dest == f"parallel.{a.flag}"
        assert options[a.option].help.startswith(a.help.replace("%", "%%"))
    from tessera.config import DEGREE_FLAGS

    assert set(DEGREE_FLAGS) == {a.flag for a in TABLE}


def test_the_flags_give_the_layout_and_the_dp_flag_counts_dp_replicate_and_dp_shard():
    from tessera.config import Config

    c = Config.create(pp=2, dp=4, dp_replicate=2, cp=2, tp=2)
    assert c.layout == Layout(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    message = r"--dp-replicate 3 must divide --dp 4 \(dp = dp_replicate x dp_shard\); use --dp 3"
    with pytest.raises(ValueError, match=message):
        axes.degrees_from_flags({"dp": 4, "dp_replicate": 3})
    with pytest.raises(ValueError, match="cp=0 must be a positive integer; use --cp 1 or more"):
        axes.degrees_from_flags({"cp": 0})


flag_value = st.integers(-1, 8)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({a.flag: flag_value for a in TABLE}))
def test_the_flags_accept_what_the_layout_accepts(flags):
    ok = all(v >= 1 for v in flags.values()) and flags["dp"] % flags["dp_replicate"] == 0
    if not ok:
        with pytest.raises(ValueError):
            axes.degrees_from_flags(flags)
        return
    layout = Layout(**axes.degrees_from_flags(flags))
    assert (layout.pp, layout.dp, layout.dp_replicate, layout.cp, layout.tp) == (
        flags["pp"], flags["dp"], flags["dp_replicate"], flags["cp"], flags["tp"])


# ----------------------------------------------------------------------------- degree rules
any_degree = st.one_of(st.integers(-3, 9), st.sampled_from([0.0, 1.0, 2.0, 4.0, 1.5, -2.0, True, False, None, "2"]))


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(NAMES), any_degree))
def test_the_degree_check_accepts_exactly_the_degrees_layout_accepts(degrees):
    def table_accepts():
        try:
            return {n: axes.check_degree(n, v) for n, v in degrees.items()}
        except ValueError:
            return None

    accepted = table_accepts()
    if accepted is None:
        with pytest.raises(ValueError):
            Layout(**degrees)
    else:
        assert Layout(**degrees).as_dict() == {**dict.fromkeys(NAMES, 1), **accepted}


# drawn so that about a third of the cases pass every check and the rest break one rule or more
shapes = st.builds(SimpleNamespace, n_heads=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]),
                   n_kv_heads=st.sampled_from([1, 2, 3, 4, 8]), ffn_dim=st.sampled_from([7, 12, 24, 48]),
                   n_layers=st.integers(1, 8))
small = st.sampled_from([1, 1, 1, 2, 2, 3, 4])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.builds(Layout, pp=small, dp_replicate=small, dp_shard=small, cp=small, tp=small), shapes,
       st.one_of(st.integers(1, 96), st.sampled_from([48, 96])), st.sampled_from([6, 8, 16, 24, 48, 7]), st.booleans())
def test_the_rules_accept_exactly_the_layouts_the_parallel_checks_accept(layout, shape, seq_len, global_batch, sp):
    """The table's rules and the checks the parallel layers run before any rank starts (tensor, context,
    pipeline split, batch rows) agree, for random models, sequences, batches and degrees."""
    from tessera.parallel.context import check_context
    from tessera.parallel.pipeline import split_layers
    from tessera.parallel.tensor import check_tensor_parallel

    def parallel_accepts() -> bool:
        try:
            check_tensor_parallel(shape, layout.tp, sp, seq_len // layout.cp)
            check_context(seq_len, layout.cp, "ring", layout.tp, sp)
            split_layers(shape.n_layers, layout.pp)
        except ValueError:
            return False
        return global_batch % layout.dp == 0

    found = layout.problems(shape, seq_len=seq_len, global_batch=global_batch, sequence_parallel=sp)
    assert (found == []) == parallel_accepts(), found


def test_rules_name_the_axis_the_rule_and_the_values():
    shape = SimpleNamespace(n_heads=8, n_kv_heads=2, ffn_dim=12, n_layers=2)
    assert Layout(tp=3, pp=4).problems(shape) == [
        "pp=4: pp must be at most n_layers (every stage holds a block); n_layers=2",
        "tp=3: tp must divide n_heads; n_heads=8",
        "tp=3: tp must divide n_kv_heads, or n_kv_heads tp (then kv heads are replicated); n_kv_heads=2",
    ]
    assert Layout(cp=2).problems(seq_len=6) == ["cp=2: 2 x cp must divide seq_len (zigzag chunks); seq_len=6"]
    assert Layout(cp=2).problems() == []  # rules whose inputs are not given are not checked


def test_planner_choices_are_powers_of_two_within_the_caps():
    shape = SimpleNamespace(n_heads=8, n_layers=3)
    assert axes.planner_degrees("tp", 64, shape, gpus_per_node=4) == [1, 2, 4]
    assert axes.planner_degrees("pp", 64, shape) == [1, 2]
    assert axes.planner_degrees("cp", 64) == [1, 2, 4, 8, 16]
    assert axes.rest_axes() == ("dp_shard", "dp_replicate") and axes.rest_axes({"dp_shard"}) == ("dp_replicate",)
    assert "sequence_parallel" in AXIS["tp"].planner.adds and "schedule" in AXIS["pp"].planner.adds


def test_an_axis_that_borrows_its_mesh_dimension_has_none_of_its_own():
    """Expert parallel's entry, as topology/axes.py's docstring gives it: dp_shard x cp's dimensions, its rules."""
    example = axes.__doc__[axes.__doc__.index('    Axis("ep"'):].strip()
    ep = eval(example, vars(axes))
    assert isinstance(ep, Axis) and ep.dim is None and "ep" not in MESH_AXES and ep.step in STEPS
    assert ep.problems({"dp_shard": 2, "cp": 2, "ep": 8}, {"n_experts": 4}) == [
        "ep must divide n_experts; n_experts=4", "ep must divide dp_shard x cp"]
    assert ep.problems({"dp_shard": 2, "cp": 2, "ep": 4}, {"n_experts": 8}) == []


def test_the_table_and_the_layout_import_no_torch():
    code = ("import sys; import tessera.topology.axes, tessera.topology.layout; from tessera.topology import Layout; "
            "Layout.infer(8, tp=2); assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr

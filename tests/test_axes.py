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
    assert MESH_AXES == Layout.AXES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert NAMES == MESH_AXES + ("ep",)  # expert parallel borrows dp_shard x cp: no dimension of its own
    assert [a.dim for a in TABLE] == [0, 1, 2, 3, 4, None]
    assert tuple(Layout().as_dict()) == NAMES  # one Layout field per entry, in its order
    assert Layout(pp=2, dp_shard=2, cp=2, tp=2).shape == (2, 1, 2, 2, 2)


def test_the_flattened_meshes_and_the_accounting_come_from_the_entries():
    assert FLATTENED == {
        "dp": ("dp_replicate", "dp_shard"),
        "dp_shard_cp": ("dp_shard", "cp"),
        "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    }
    assert list(FLATTENED) == ["dp", "dp_shard_cp", "dp_cp"]  # build_mesh flattens in this order
    assert COMM_AXES == (
        "pp",
        "dp_replicate",
        "dp_shard_cp",
        "cp",
        "tp",
        "ep",
    )  # topology/estimators/comm_model.py's keys
    purposes = {f.purpose: f.name for f in axes.FLATTENED_MESHES}
    assert purposes == {"batch": "dp", "fsdp": "dp_shard_cp", "loss": "dp_cp"}
    assert {a.mesh for a in TABLE if a.mesh} == {"tp", "pp", "cp", "ep"}


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
        flags["pp"],
        flags["dp"],
        flags["dp_replicate"],
        flags["cp"],
        flags["tp"],
    )


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
shapes = st.builds(
    SimpleNamespace,
    n_heads=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]),
    n_kv_heads=st.sampled_from([1, 2, 3, 4, 8]),
    ffn_dim=st.sampled_from([7, 12, 24, 48]),
    n_layers=st.integers(1, 8),
)
small = st.sampled_from([1, 1, 1, 2, 2, 3, 4])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.builds(Layout, pp=small, dp_replicate=small, dp_shard=small, cp=small, tp=small),
    shapes,
    st.one_of(st.integers(1, 96), st.sampled_from([48, 96])),
    st.sampled_from([6, 8, 16, 24, 48, 7]),
    st.booleans(),
)
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
    """Expert parallel's entry: dp_shard x cp's dimensions, its rules (a dense model, n_experts 0, takes ep 1 only)."""
    ep = AXIS["ep"]
    assert isinstance(ep, Axis) and ep.dim is None and "ep" not in MESH_AXES and ep.step in STEPS
    assert ep.borrows == ("dp_shard", "cp") and Layout(dp_shard=4, ep=2).world_size == 4
    assert ep.problems({"dp_shard": 2, "cp": 2, "ep": 8}, {"n_experts": 4}) == [
        "ep needs a mixture-of-experts model and must divide n_experts; n_experts=4",
        "ep must divide dp_shard x cp (the ranks it borrows): raise `dp` or `cp`",
    ]
    assert ep.problems({"dp_shard": 2, "cp": 2, "ep": 4}, {"n_experts": 8}) == []
    assert ep.problems({"dp_shard": 2, "cp": 1, "ep": 2}, {"n_experts": 0}) != []


def test_the_table_and_the_layout_import_no_torch():
    code = (
        "import sys; import tessera.topology.axes, tessera.topology.layout; from tessera.topology import Layout; "
        "Layout.infer(8, tp=2); assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# ----------------------------------------------------------------------------- the planner and the accounting read it
def _extra_axis() -> Axis:
    """A hypothetical axis built here, not registered: cp's entry under a new name, with its own rule and cap."""
    from dataclasses import replace

    return replace(
        AXIS["cp"],
        name="xp",
        flag="xp",
        counts=("xp",),
        mesh=None,
        meshes=(),
        comm="xp",
        rules=(axes.Rule(("seq_len",), lambda d, v: v["seq_len"] % d["xp"] == 0, "xp must divide seq_len"),),
        planner=axes.Planner(caps=(4,)),
    )


def test_the_planner_enumerates_the_axes_of_the_table_it_is_given():
    """An extra entry is enumerated with no change to the planner: its degrees within its cap, the ranks left
    over still going to dp_shard, and the layouts with it at 1 exactly the table's own."""
    from tessera.topology.estimators.planner import Hardware, layout_degrees

    shape = SimpleNamespace(n_heads=8, n_kv_heads=2, ffn_dim=64, n_layers=4)
    hw = Hardware(gpus=16)
    base = layout_degrees(shape, hw, 256, 32)
    extended = layout_degrees(shape, hw, 256, 32, table=TABLE[:4] + (_extra_axis(),) + TABLE[4:])
    assert all(list(d) == list(NAMES) for d in base)
    assert all(list(d) == [*NAMES[:4], "xp", *NAMES[4:]] for d in extended)
    assert {d["xp"] for d in extended} == {1, 2, 4}  # powers of two within its cap
    assert all(d["pp"] * d["dp_replicate"] * d["dp_shard"] * d["cp"] * d["xp"] * d["tp"] == 16 for d in extended)
    assert [{k: v for k, v in d.items() if k != "xp"} for d in extended if d["xp"] == 1] == base
    assert len(extended) > len(base)
    # its rule prunes it like the table's own: xp=4 does not divide a sequence of 6
    assert {d["xp"] for d in layout_degrees(shape, Hardware(gpus=8), 6, 8, table=TABLE + (_extra_axis(),))} == {1, 2}


def test_a_borrowed_axis_is_enumerated_over_the_dimensions_it_borrows():
    """Expert parallel's entry: no ranks of its own, its degree a power of two dividing dp_shard x cp and the
    experts; a dense model (n_experts 0) gets ep 1 only."""
    from tessera.topology.estimators.planner import Hardware, layout_degrees

    shape = SimpleNamespace(n_heads=8, n_kv_heads=8, ffn_dim=64, n_layers=4, n_experts=4)
    found = layout_degrees(shape, Hardware(gpus=16), 256, 32)
    dense = layout_degrees(SimpleNamespace(**{**vars(shape), "n_experts": 0}), Hardware(gpus=16), 256, 32)
    assert dense and {d["ep"] for d in dense} == {1}
    assert {d["ep"] for d in found} == {1, 2, 4}
    assert all(d["dp_shard"] * d["cp"] % d["ep"] == 0 and d["ep"] <= 4 for d in found)
    assert all(d["pp"] * d["dp_replicate"] * d["dp_shard"] * d["cp"] * d["tp"] == 16 for d in found)


def test_a_candidates_flags_give_back_its_layout():
    """Candidate.flags writes each axis's flag of the table (--dp: dp_replicate x dp_shard); the train
    command's fields read them back to the same layout."""
    import shlex

    from tessera.commands.plan import model_shape
    from tessera.topology.estimators.planner import Hardware, candidates

    for cand in candidates(model_shape("8b"), Hardware(gpus=16), 4096, 64)[::17]:
        words = shlex.split(cand.flags())
        given = {
            w[2:].replace("-", "_"): int(v)
            for w, v in zip(words, words[1:] + [""])
            if w[2:].replace("-", "_") in axes.FLAGS
        }
        assert Layout(**axes.degrees_from_flags(given)) == cand.layout, cand.flags()


def test_the_accounting_names_are_the_tables():
    """comm_model gives bytes under every accounting name of the table (one volume each) and the planner
    times each over its group's links, overlapping the ones the table says overlap compute."""
    from tessera.commands.plan import model_shape
    from tessera.topology.estimators import comm_model
    from tessera.topology.estimators.planner import Candidate, Hardware, estimate

    assert set(comm_model.VOLUMES) == set(COMM_AXES)
    assert axes.COMM_GROUPS == {
        "pp": ("pp",),
        "dp_replicate": ("dp_replicate",),
        "dp_shard_cp": ("dp_shard", "cp"),
        "cp": ("cp",),
        "tp": ("tp",),
        "ep": ("dp_shard", "cp"),
    }
    assert axes.OVERLAPPED == ("dp_replicate", "dp_shard_cp", "cp")
    layout = Layout(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    comm = comm_model.comm_bytes_per_step(model_shape("debug"), layout, 64, 8, 2, True)
    assert set(comm) == set(COMM_AXES) and all(v > 0 for n, v in comm.items() if n != "ep")
    assert comm["ep"] == 0  # a dense model: nothing to dispatch
    x = estimate(model_shape("debug"), Candidate(layout, microbatches=2), Hardware(gpus=32), 64, 8)
    exposed = [n for n in comm if n not in axes.OVERLAPPED]
    assert list(x.time) == ["compute", "bubble", *exposed, "exposed_overlapped_comm", "step"]


def _axis_listings(path) -> list[str]:
    """Tuple, list and set literals naming two or more axes (or accounting names), and dict literals keyed by
    two or more with values that are not wording: axes spelled out by hand."""
    import ast

    names = set(MESH_AXES) | set(COMM_AXES) | set(FLATTENED)

    def named(nodes) -> int:
        return sum(isinstance(n, ast.Constant) and n.value in names for n in nodes if n is not None)

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and named(node.elts) >= 2:
            out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        if (
            isinstance(node, ast.Dict)
            and named(node.keys) >= 2
            and not all(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in node.values)
        ):
            out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    return out


def test_the_planner_and_the_comm_model_spell_out_no_axes(tmp_path):
    """Their axes, caps, rest axis, flags and accounting names come from the table: no literal listing axes."""
    from pathlib import Path

    import tessera.topology.estimators.comm_model
    import tessera.topology.estimators.plan_inputs
    import tessera.topology.estimators.planner
    import tessera.topology.estimators.rank_memory
    import tessera.topology.estimators.step_estimate

    modules = (
        tessera.topology.estimators.planner,
        tessera.topology.estimators.plan_inputs,
        tessera.topology.estimators.rank_memory,
    )
    for module in (*modules, tessera.topology.estimators.step_estimate, tessera.topology.estimators.comm_model):
        assert _axis_listings(Path(module.__file__)) == []
    # the check finds what it looks for: the planner's and the comm model's former spellings
    probe = tmp_path / "probe.py"
    probe.write_text('for a in ("pp", "cp", "tp"): pass\nout = {"tp": 0.0, "dp_shard_cp": 0.0}\n')
    assert len(_axis_listings(probe)) == 2


def test_parallelize_applies_the_steps_in_the_tables_order():
    import inspect

    from tessera.parallel.parallelize import parallelize

    source = inspect.getsource(parallelize)
    calls = {
        "tp": "apply_plan(",
        "cp": "apply_cp(",
        "ac": "apply_activation_checkpointing(",
        "compile": "apply_compile(",
        "fsdp": "apply_fsdp(",
    }
    assert tuple(calls) == STEPS[STEPS.index("pp") + 1 :]
    positions = [source.index(calls[s]) for s in calls]
    assert positions == sorted(positions)

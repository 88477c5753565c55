"""The parallel axes as data: one table, read by the layout, the meshes, the command line, the planner and
the communication accounting. Pure Python: no torch.

Each `Axis` says
    name, dim      its name and its mesh dimension (the position in `MESH_AXES`: pp outermost, tp innermost,
                   so a tp group is consecutive ranks on one node); `borrows` instead of a dimension of its own
    rules          its degree rules: small predicates over the degrees and a model's shape (anything with a
                   ModelShape's attributes: n_heads, n_kv_heads, ffn_dim, n_layers, ...) plus the sequence
                   length and the global batch, each with the sentence it enforces
    step           where it is applied (`STEPS`: pp cuts the model at build time, then parallelize applies
                   tp -> cp -> activation checkpointing -> compile -> fsdp)
    shards         what it splits (of `SHARDS`: layers, parameters, sequence, batch) and how, in words
    flag, help     its `tessera train` flag (the ParallelSection field of that name) and help line; `counts`:
                   the axes whose product the flag gives (--dp is dp_replicate x dp_shard)
    mesh, meshes   the purpose mesh of its own 1-D group in `Meshes` (tp, pp, cp), and the flattened meshes
                   it is part of (`FLATTENED_MESHES`: batch, fsdp, loss)
    comm           the name its traffic is accounted under (parallel/comm_stats.py, topology/estimators/comm_model.py)
    planner        the planner's choices: degree caps, the options it enumerates with the axis on, whether the
                   axis takes the ranks left over, and whether its traffic overlaps compute in the step time

A new axis is one entry here, a field of that name on `Layout` (an import-time check says so), its apply
function in parallel/ and the volume of its traffic in topology/estimators/comm_model.py (another import-time check);
the planner enumerates its degrees from the entry (planner.py's `layout_degrees`). Expert parallelism
has no dimension of its own: its entry borrows dp_shard x cp (`borrows=("dp_shard", "cp")`, as torchtitan
does), so the mesh's shape and `MESH_AXES` stay as they are; it is applied beside tp (step "tp", as
torchtitan's apply_moe_ep_tp), by parallel/expert.py.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from tessera.topology.shapes import kv_heads_fit

# the order parallel axes and the other steps are applied in: pp keeps a rank's stage(s) when the model is
# built; parallelize (parallel/parallelize.py) then applies the rest in this order
STEPS: tuple[str, ...] = ("pp", "tp", "cp", "ac", "compile", "fsdp")

# what an axis can split: blocks over stages, parameter tensors, each sequence, the global batch's rows
SHARDS: tuple[str, ...] = ("layers", "parameters", "sequence", "batch")


@dataclass(frozen=True)
class Rule:
    """One degree rule. `holds(degrees, values)` reads the layout's degrees (every axis by name) and the values
    named in `needs` (a model shape's attributes, "seq_len", "global_batch", "sequence_parallel"); it is
    checked only when all of them are given. `says` is the rule in words, for messages and documentation."""

    needs: tuple[str, ...]
    holds: Callable[[Mapping[str, int], Mapping[str, Any]], bool]
    says: str


@dataclass(frozen=True)
class Planner:
    """The planner's choices for an axis: powers of two dividing the ranks left, at most each of `caps` (a
    model shape's attribute, "gpus_per_node", or a number), then the options it enumerates with the axis on
    (`adds`). `rest`: the axis takes the ranks the others leave (dp_shard), instead of being enumerated.
    `overlapped`: its traffic overlaps compute in the planner's step time (FSDP's gathers and reduce-scatters,
    HSDP's all-reduce, ring K/V: only their excess over compute is exposed); otherwise it is exposed (tp, pp)."""

    caps: tuple[str | int, ...] = ()
    adds: tuple[str, ...] = ()
    rest: bool = False
    overlapped: bool = False


@dataclass(frozen=True)
class Axis:
    name: str
    step: str
    shards: tuple[str, ...]
    doc: str  # what it shards, in words
    flag: str  # the ParallelSection field and `tessera train` flag (--{flag with dashes})
    help: str
    counts: tuple[str, ...]  # the axes whose product the flag gives
    rules: tuple[Rule, ...] = ()
    mesh: str | None = None  # Meshes attribute of its own 1-D group (None: part of a flattened mesh only)
    meshes: tuple[str, ...] = ()  # names of the flattened meshes it is part of
    comm: str = ""  # the name its bytes are accounted under (default: its own name)
    planner: Planner = field(default_factory=Planner)
    borrows: tuple[str, ...] = ()  # the axes whose mesh dimensions it reuses (no dimension of its own)

    @property
    def dim(self) -> int | None:
        """Its mesh dimension (position in MESH_AXES); None for an axis that borrows others' dimensions."""
        return None if self.borrows else MESH_AXES.index(self.name)

    @property
    def order(self) -> int:
        """Its position in the order of application (STEPS)."""
        return STEPS.index(self.step)

    @property
    def option(self) -> str:
        """Its command-line option, e.g. --dp-replicate."""
        return "--" + self.flag.replace("_", "-")

    def problems(self, degrees: Mapping[str, int], values: Mapping[str, Any]) -> list[str]:
        """The rules this axis's degree breaks, in words with the values they read (rules whose inputs are
        not all given are skipped)."""
        out = []
        for r in self.rules:
            if all(values.get(n) is not None for n in r.needs) and not r.holds(degrees, values):
                out.append(r.says + "".join(f"; {n}={values[n]}" for n in r.needs))
        return out


def _kv(d: Mapping[str, int], v: Mapping[str, Any]) -> bool:
    return kv_heads_fit(v["n_kv_heads"], d["tp"])


def _sp(d: Mapping[str, int], v: Mapping[str, Any]) -> bool:
    return not v["sequence_parallel"] or d["tp"] == 1 or (v["seq_len"] // d["cp"]) % d["tp"] == 0


TABLE: tuple[Axis, ...] = (
    Axis(
        "pp",
        step="pp",
        shards=("layers",),
        doc="the blocks: each stage holds a contiguous run of them (and the "
        "embedding on the first, the norm and head on the last); activations pass point to point",
        flag="pp",
        counts=("pp",),
        help="pipeline-parallel ranks (stages of the model, each on its own ranks)",
        rules=(
            Rule(
                ("n_layers",),
                lambda d, v: d["pp"] <= v["n_layers"],
                "pp must be at most n_layers (every stage holds a block)",
            ),
        ),
        mesh="pp",
        planner=Planner(caps=("n_layers",), adds=("schedule", "virtual", "microbatches")),
    ),
    Axis(
        "dp_replicate",
        step="fsdp",
        shards=("batch",),
        doc="the global batch's rows; replicas of the FSDP shard group (HSDP): gradients all-reduced across them",
        flag="dp_replicate",
        counts=("dp_replicate",),
        help="replicas of the FSDP shard group (HSDP); must divide --dp",
        meshes=("dp", "dp_cp"),
        planner=Planner(overlapped=True),
    ),
    Axis(
        "dp_shard",
        step="fsdp",
        shards=("batch", "parameters"),
        doc="the global batch's rows, and (FSDP2, over dp_shard x cp) the parameters, gradients and optimizer state",
        flag="dp",
        counts=("dp_replicate", "dp_shard"),
        help="data-parallel degree (dp_replicate x dp_shard), sharded with FSDP2",
        rules=(
            Rule(
                ("global_batch",),
                lambda d, v: v["global_batch"] % (d["dp_replicate"] * d["dp_shard"]) == 0,
                "dp = dp_replicate x dp_shard must divide the global batch",
            ),
        ),
        meshes=("dp", "dp_shard_cp", "dp_cp"),
        comm="dp_shard_cp",
        planner=Planner(adds=("strategy",), rest=True, overlapped=True),
    ),
    Axis(
        "cp",
        step="cp",
        shards=("sequence", "parameters"),
        doc="each sequence: 2 x cp zigzag chunks, rank i keeps "
        "chunks i and 2cp-1-i; K/V pass the ring. cp ranks hold the same parameters, so FSDP2 shards over them too",
        flag="cp",
        counts=("cp",),
        help="context-parallel degree: each sequence split over cp ranks (zigzag), attention over the ring",
        rules=(
            Rule(
                ("seq_len",),
                lambda d, v: d["cp"] == 1 or v["seq_len"] % (2 * d["cp"]) == 0,
                "2 x cp must divide seq_len (zigzag chunks)",
            ),
        ),
        mesh="cp",
        meshes=("dp_shard_cp", "dp_cp"),
        planner=Planner(caps=(16,), overlapped=True),
    ),
    Axis(
        "tp",
        step="tp",
        shards=("parameters",),
        doc="the heads, the MLP width and the vocabulary (column / row "
        "parallel); with sequence parallel, the norms' activations along the sequence",
        flag="tp",
        counts=("tp",),
        help="tensor-parallel degree",
        rules=(
            Rule(("n_heads",), lambda d, v: v["n_heads"] % d["tp"] == 0, "tp must divide n_heads"),
            Rule(("n_kv_heads",), _kv, "tp must divide n_kv_heads, or n_kv_heads tp (then kv heads are replicated)"),
            Rule(("ffn_dim",), lambda d, v: v["ffn_dim"] % d["tp"] == 0, "tp must divide ffn_dim"),
            Rule(("seq_len", "sequence_parallel"), _sp, "with sequence parallel, tp must divide seq_len / cp"),
        ),
        mesh="tp",
        planner=Planner(caps=("gpus_per_node", "n_heads"), adds=("sequence_parallel",)),
    ),
    Axis(
        "ep",
        step="tp",
        shards=("parameters",),
        doc="the routed experts of each MoE block: each ep rank holds "
        "n_experts / ep of them and receives their tokens by all-to-all; the ep ranks are a subgroup of dp_shard x cp "
        "(cp innermost, as torchtitan takes them), and the experts are FSDP-sharded over what is left",
        flag="ep",
        counts=("ep",),
        help="expert-parallel degree: the experts of each MoE block split over ranks of dp_shard x cp (no ranks of "
        "its own)",
        rules=(
            Rule(
                ("n_experts",),
                lambda d, v: d["ep"] == 1 or (v["n_experts"] > 0 and v["n_experts"] % d["ep"] == 0),
                "ep needs a mixture-of-experts model and must divide n_experts",
            ),
            Rule(
                (),
                lambda d, v: d["dp_shard"] * d["cp"] % d["ep"] == 0,
                "ep must divide dp_shard x cp (the ranks it borrows): raise `dp` or `cp`",
            ),
        ),
        borrows=("dp_shard", "cp"),
        mesh="ep",
        comm="ep",
        planner=Planner(caps=("n_experts",)),
    ),
)

AXIS: dict[str, Axis] = {a.name: a for a in TABLE}

# the mesh's dimensions, outermost first: the axes with a dimension of their own
MESH_AXES: tuple[str, ...] = tuple(a.name for a in TABLE if not a.borrows)


@dataclass(frozen=True)
class Flattened:
    """A flattened submesh of `Layout.build_mesh`: its axes (mesh order) are the entries that list it in
    `meshes`. `purpose` is its Meshes attribute; `replicate`: the axis it is replicated over, which makes the
    purpose mesh 2-D (replicate, name) when that axis is on (HSDP)."""

    name: str
    purpose: str
    doc: str
    replicate: str | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a.name for a in TABLE if self.name in a.meshes)


FLATTENED_MESHES: tuple[Flattened, ...] = (
    Flattened("dp", "batch", "data loading: ranks with the same dp coordinate read the same batch slice"),
    Flattened(
        "dp_shard_cp",
        "fsdp",
        "FSDP2 sharding: cp ranks hold identical parameters, so they shard them too",
        replicate="dp_replicate",
    ),
    Flattened("dp_cp", "loss", "loss and gradient reduction across every rank that sees different tokens"),
)

# flattened name -> its axes, in mesh order
FLATTENED: dict[str, tuple[str, ...]] = {f.name: f.axes for f in FLATTENED_MESHES}
FLATTENED_BY_PURPOSE: dict[str, Flattened] = {f.purpose: f for f in FLATTENED_MESHES}

# the names communication is accounted under, mesh order (comm_stats counts them, comm_model predicts them)
COMM_AXES: tuple[str, ...] = tuple(dict.fromkeys(a.comm or a.name for a in TABLE))


def comm_groups(table: Iterable[Axis] = TABLE) -> dict[str, tuple[str, ...]]:
    """Each accounting name -> the mesh axes of the group its traffic crosses: a flattened mesh's axes
    (dp_shard_cp: dp_shard x cp), the dimensions an axis borrows, or the axis's own."""
    out: dict[str, tuple[str, ...]] = {}
    for a in table:
        name = a.comm or a.name
        out.setdefault(name, FLATTENED[name] if name in FLATTENED else a.borrows or (a.name,))
    return out


# accounting name -> its group's mesh axes; the names whose traffic overlaps compute (the planner's step time)
COMM_GROUPS: dict[str, tuple[str, ...]] = comm_groups()
OVERLAPPED: tuple[str, ...] = tuple(dict.fromkeys(a.comm or a.name for a in TABLE if a.planner.overlapped))

# the command line's degree fields (ParallelSection): one per axis
FLAGS: tuple[str, ...] = tuple(a.flag for a in TABLE)


def _check_table() -> None:
    names = [a.name for a in TABLE]
    assert len(set(names)) == len(names), f"axis names repeat: {names}"
    assert len(set(FLAGS)) == len(FLAGS), f"axis flags repeat: {FLAGS}"
    for a in TABLE:
        assert a.step in STEPS and set(a.shards) <= set(SHARDS), a
        assert set(a.counts) <= set(names) and a.name in a.counts, a
        assert set(a.borrows) <= set(MESH_AXES), a
        assert set(a.meshes) <= {f.name for f in FLATTENED_MESHES}, a
    assert sum(a.planner.rest for a in TABLE) == 1, "one axis takes the ranks the others leave"


_check_table()


# ----------------------------------------------------------------------------- degrees
def check_degree(name: str, value: object) -> int:
    """A degree as an int: a positive whole number (an integral float is accepted); ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer() and value > 0:
            return int(value)
        raise ValueError(f"{name}={value!r} is not a whole number; degrees are positive integers, e.g. {name}=2")
    if value <= 0:
        raise ValueError(f"{name}={value} must be a positive integer; use {name}=1 to leave the axis unused")
    return int(value)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rest_axes(fixed: Iterable[str] = ()) -> tuple[str, ...]:
    """The axes that take the ranks left over, most preferred first, leaving out `fixed`: the planner's rest
    axis (dp_shard), then the other axes its flag counts (dp_replicate: HSDP replicas of the shard group)."""
    rest = next(a for a in TABLE if a.planner.rest)
    order = (rest.name,) + tuple(n for n in rest.counts if n != rest.name)
    return tuple(n for n in order if n not in set(fixed))


def values_of(shape: Any = None, *, table: Iterable[Axis] = TABLE, **values: Any) -> dict[str, Any]:
    """The inputs of the rules (of `table`'s entries): a shape's attributes (a ModelShape, a family's config,
    anything with them) plus the keyword values (seq_len, global_batch, sequence_parallel)."""
    out: dict[str, Any] = {}
    if shape is not None:
        for a in table:
            for r in a.rules:
                for n in r.needs:
                    if hasattr(shape, n):
                        out[n] = getattr(shape, n)
    out.update({k: v for k, v in values.items() if v is not None})
    return out


def problems(degrees: Mapping[str, int], shape: Any = None, **values: Any) -> list[str]:
    """Every rule the degrees break for this shape and these values, in words, axis by axis (empty: none).
    `degrees` may leave axes out (taken as 1)."""
    full = {a.name: int(degrees.get(a.name, 1)) for a in TABLE}
    given = values_of(shape, **values)
    return [f"{a.name}={full[a.name]}: {p}" for a in TABLE for p in a.problems(full, given)]


def degrees_from_flags(flags: Mapping[str, int], global_batch: int | None = None) -> dict[str, int]:
    """The degrees the command line's fields ask for (an axis whose flag counts several axes, --dp, gets the
    quotient): ValueError naming the flag and the fix. With the `global_batch`, the fix a refused --dp is given
    also splits it (the batch's own check would refuse the next try), or the message names both constraints."""
    for a in TABLE:
        value = flags.get(a.flag, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{a.flag}={value} must be a positive integer; use {a.option} 1 or more")
    out: dict[str, int] = {}
    for a in TABLE:  # the flags of one axis first, then the products that contain them
        if a.counts == (a.name,):
            out[a.name] = flags.get(a.flag, 1)
    for a in TABLE:
        if a.counts != (a.name,):
            others = [AXIS[n] for n in a.counts if n != a.name]
            value, per = flags.get(a.flag, 1), math.prod(out[o.name] for o in others)
            if value % per:
                names = " x ".join(a.counts)
                raise ValueError(
                    f"{' x '.join(f'{o.option} {out[o.name]}' for o in others)} must divide {a.option} {value} "
                    f"({a.flag} = {names}); {_product_fix(a, others, value, per, global_batch)}"
                )
            out[a.name] = value // per
    return {a.name: out[a.name] for a in TABLE}


def _product_fix(a: Axis, others: list[Axis], value: int, per: int, global_batch: int | None) -> str:
    """The fix of a product flag (--dp) that the others' degrees (--dp-replicate) do not divide: the multiple of
    them nearest `value` that also splits `global_batch` (when known); when none does, the others' degrees
    that divide `value` and a batch that the nearest multiple splits."""
    nearest = per * max(1, value // per)
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        return f"use {a.option} {nearest}"
    splitting = [m for m in range(per, global_batch + 1, per) if global_batch % m == 0]
    if splitting:
        return f"use {a.option} {min(splitting, key=lambda m: (abs(m - value), m))}"
    fixes = []
    if len(others) == 1 and global_batch % value == 0:  # keep the product, change the other degree
        (other,) = others
        degrees = [d for d in range(2, value + 1) if value % d == 0]
        if degrees:
            listed = ", ".join(map(str, degrees[:-1])) + " or " if len(degrees) > 1 else ""
            fixes.append(f"{other.option} {listed}{degrees[-1]} (dividing {a.option} {value})")
    fixes.append(f"{a.option} {nearest} with global_batch={-(-global_batch // nearest) * nearest}")
    return f"no multiple of {per} splits global_batch={global_batch} either: use {', or '.join(fixes)}"


def planner_degrees(axis: str | Axis, ranks: int, shape: Any = None, gpus_per_node: int | None = None) -> list[int]:
    """The degrees the planner tries for `axis` (a name, or an entry) with `ranks` left: powers of two
    dividing them, within the axis's caps (a cap whose value is not given is skipped)."""
    a = axis if isinstance(axis, Axis) else AXIS[axis]
    caps = [
        c if isinstance(c, int) else gpus_per_node if c == "gpus_per_node" else getattr(shape, c, None)
        for c in a.planner.caps
    ]
    caps = [c if c is None else max(1, c) for c in caps]  # a cap of 0 (a dense model's n_experts) leaves degree 1
    return [d for d in divisors(ranks) if d & (d - 1) == 0 and all(c is None or d <= c for c in caps)]

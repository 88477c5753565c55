"""Layout: how a world of ranks factors into the five mesh axes.

The axes, their order and their flattened submeshes are the table of topology/axes.py: ("pp",
"dp_replicate", "dp_shard", "cp", "tp"). tp is innermost, so a tp group is a run of consecutive ranks (one
node, fastest links); pp is outermost. A rank's coordinate is the row-major unravel of the rank over
`shape`. Everything here is pure arithmetic, so it is cheap to property-test; `build_mesh` is the one
method that talks to torch.distributed (through topology/device_mesh.py, imported when it is called).
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from tessera.topology.axes import FLATTENED, MESH_AXES, TABLE, check_degree, divisors, problems, rest_axes

if TYPE_CHECKING:  # torch is imported lazily so `tessera memory` and pure tests start fast
    from torch.distributed.device_mesh import DeviceMesh

# the mesh's axes, outermost first, and its flattened submeshes (name -> axes, in mesh order):
#   dp          data loading: ranks with the same dp coordinate read the same batch slice
#   dp_shard_cp FSDP2 sharding: cp ranks hold identical parameters, so they shard them too
#   dp_cp       loss and gradient reduction across every rank that sees different tokens
AXES: tuple[str, ...] = MESH_AXES
_check_degree = check_degree


def _suggest(n: int, bad: int) -> str:
    """The divisors of n nearest to `bad` (one below, one above), for error messages."""
    ds = [d for d in divisors(n) if d > 1] or [1]
    below = [d for d in ds if d < bad]
    above = [d for d in ds if d > bad]
    picks = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return " or ".join(str(p) for p in picks)


@dataclass(frozen=True)
class Layout:
    """Degrees of the parallel axes (one field per entry of topology/axes.py's table, checked at import);
    every degree defaults to 1."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # borrows dp_shard x cp: no ranks of its own (topology/axes.py)

    AXES = AXES
    FLATTENED = FLATTENED

    def __post_init__(self) -> None:
        for axis in TABLE:
            object.__setattr__(self, axis.name, _check_degree(axis.name, getattr(self, axis.name)))

    # ----------------------------------------------------------------- construction
    @classmethod
    def infer(cls, world_size: int, **fixed: int) -> "Layout":
        """Fix some degrees; the ranks left over go to dp_shard (to dp_replicate when dp_shard is fixed).

        >>> Layout.infer(16, tp=2, pp=2, cp=2)
        Layout(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2)
        """
        world_size = _check_degree("world_size", world_size)
        names = tuple(a.name for a in TABLE)
        unknown = sorted(set(fixed) - set(names))
        if unknown:
            raise ValueError(f"unknown axis {unknown[0]!r}; the axes are {', '.join(names)}")
        degrees = {axis: _check_degree(axis, v) for axis, v in fixed.items()}
        for axis, d in degrees.items():
            if world_size % d:
                raise ValueError(
                    f"{world_size} ranks cannot hold {axis}={d}: {axis} must divide {world_size}; "
                    f"try {axis}={_suggest(world_size, d).replace(' or ', f' or {axis}=')}"
                )
        product = math.prod(d for axis, d in degrees.items() if axis in AXES)  # borrowed axes use no ranks
        # the rest goes to dp_shard; if dp_shard is fixed, to dp_replicate (HSDP replicas of the shard group)
        rest = rest_axes(degrees)
        if not rest:
            if product != world_size:
                raise ValueError(
                    f"{world_size} ranks cannot hold {_describe(degrees)} = {product} ranks; the degrees must "
                    f"multiply to {world_size}; leave dp_shard out to let it take the rest"
                )
            return cls(**degrees)
        if world_size % product:
            raise ValueError(
                f"{world_size} ranks cannot hold {_describe(degrees)} = {product} ranks: {product} does not divide "
                f"{world_size}; choose degrees whose product divides {world_size} (e.g. use "
                f"{_nearest_world(world_size, product)} ranks, or change a degree)"
            )
        return cls(**{**degrees, rest[0]: world_size // product})

    # ----------------------------------------------------------------- shape
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicate x shard): how many different batch slices a step reads."""
        return self.dp_replicate * self.dp_shard

    def degree(self, axis: str | Sequence[str]) -> int:
        return math.prod(getattr(self, a) for a in self._axes_of(axis))

    def as_dict(self) -> dict[str, int]:
        return {axis.name: getattr(self, axis.name) for axis in TABLE}

    def __str__(self) -> str:
        return " x ".join(f"{a.name}{getattr(self, a.name)}" for a in TABLE if getattr(self, a.name) > 1) or "single"

    def problems(self, shape=None, **values) -> list[str]:
        """The degree rules of topology/axes.py's table these degrees break for a model's shape (a ModelShape,
        a family's config) and the values given (seq_len, global_batch, sequence_parallel), in words."""
        return problems(self.as_dict(), shape, **values)

    def check_world_size(self, world_size: int) -> None:
        """Raise if this layout does not use exactly `world_size` ranks (e.g. WORLD_SIZE under torchrun)."""
        if world_size != self.world_size:
            raise ValueError(
                f"layout {self} uses {self.world_size} ranks but WORLD_SIZE is {world_size}; launch "
                f"{self.world_size} ranks, or choose degrees whose product is {world_size}"
            )

    # ----------------------------------------------------------------- rank <-> coordinates
    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank!r} is outside this layout's {self.world_size} ranks (0..{self.world_size - 1})"
            )
        return int(rank)

    def coords(self, rank: int) -> dict[str, int]:
        """Row-major unravel of `rank` over `shape` (tp fastest)."""
        rest = self._check_rank(rank)
        out: dict[str, int] = {}
        for axis in reversed(AXES):
            size = getattr(self, axis)
            out[axis] = rest % size
            rest //= size
        return {axis: out[axis] for axis in AXES}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """Inverse of `coords`; axes left out of `coords` are taken as 0."""
        unknown = sorted(set(coords) - set(AXES))
        if unknown:
            raise ValueError(f"unknown axis {unknown[0]!r}; the axes are {', '.join(AXES)}")
        rank = 0
        for axis in AXES:
            size, c = getattr(self, axis), coords.get(axis, 0)
            if not 0 <= c < size:
                raise ValueError(f"coordinate {axis}={c} is outside 0..{size - 1} for {axis}={size}")
            rank = rank * size + c
        return rank

    def _axes_of(self, axis: str | Sequence[str]) -> tuple[str, ...]:
        if isinstance(axis, str):
            if axis in FLATTENED:
                return FLATTENED[axis]
            if axis in AXES:
                return (axis,)
            raise ValueError(f"unknown axis {axis!r}; use one of {', '.join(AXES + tuple(FLATTENED))}")
        axes = tuple(axis)
        for a in axes:
            if a not in AXES:
                raise ValueError(f"unknown axis {a!r}; use one of {', '.join(AXES)}")
        return tuple(a for a in AXES if a in axes)  # mesh order

    def group(self, axis: str | Sequence[str], rank: int) -> list[int]:
        """Ranks that differ from `rank` only along `axis` (an axis, a flattened name or a tuple of axes),
        ordered by their coordinate on those axes, as DeviceMesh orders its groups."""
        axes = self._axes_of(axis)
        base = self.coords(rank)
        members = []
        for idx in _product_ranges([getattr(self, a) for a in axes]):
            c = dict(base)
            c.update(zip(axes, idx))
            members.append(self.rank_of(c))
        return members

    def index(self, axis: str | Sequence[str], rank: int) -> int:
        """Position of `rank` in its group along `axis`: `group(axis, rank).index(rank)`, computed directly.
        index("dp", rank) is the slice of the global batch the rank reads."""
        c = self.coords(rank)
        out = 0
        for a in self._axes_of(axis):
            out = out * getattr(self, a) + c[a]
        return out

    def groups(self, axis: str | Sequence[str]) -> list[list[int]]:
        """All groups of `axis`; they partition the world."""
        seen: set[int] = set()
        out = []
        for r in range(self.world_size):
            if r not in seen:
                g = self.group(axis, r)
                seen.update(g)
                out.append(g)
        return out

    # ----------------------------------------------------------------- DeviceMesh
    def build_mesh(
        self, device_type: str, gpus_per_node: int | None = None, timeout: float | None = None
    ) -> "DeviceMesh":
        """One DeviceMesh with the five axes plus the flattened "dp", "dp_shard_cp" and "dp_cp" submeshes.

        Must run inside an initialized process group whose world size equals this layout's. Slice the
        result with `topology.submesh(mesh, name)`. `timeout` (seconds) bounds every collective on every
        subgroup of the mesh: torch creates them with its own default (30 minutes on gloo, 10 on NCCL),
        not the world group's timeout, so a stalled tp or FSDP collective would otherwise hang that long.
        """
        from tessera.topology import device_mesh  # lazy: the DeviceMesh side imports torch; this module does not

        self.check_world_size(device_mesh.world_size())
        if gpus_per_node is not None:
            self.check_nodes(gpus_per_node)
        return device_mesh.init_mesh(self.shape, device_type, timeout)

    def check_nodes(self, gpus_per_node: int) -> None:
        """Warn when a tp group would cross a node boundary (tp traffic then leaves NVLink)."""
        gpus_per_node = _check_degree("gpus_per_node", gpus_per_node)
        if self.tp > gpus_per_node or gpus_per_node % self.tp:
            warnings.warn(
                f"tp={self.tp} groups span nodes of {gpus_per_node} GPUs: tensor-parallel collectives will cross "
                f"the inter-node network; use tp dividing {gpus_per_node} (e.g. tp={_suggest(gpus_per_node, self.tp)})",
                stacklevel=2,
            )


# one degree field per axis of the table, in its order (a new axis: add its field above, default 1)
if tuple(f.name for f in fields(Layout)) != tuple(a.name for a in TABLE):
    raise ImportError(
        f"Layout's fields {[f.name for f in fields(Layout)]} differ from topology/axes.py's table "
        f"{[a.name for a in TABLE]}: give Layout one degree field per axis, in the table's order"
    )


def _describe(degrees: Mapping[str, int]) -> str:
    return " x ".join(f"{a}={d}" for a, d in degrees.items()) or "no fixed degrees"


def _nearest_world(world_size: int, product: int) -> int:
    return max(product, (world_size // product) * product)


def _product_ranges(sizes: Iterable[int]) -> Iterable[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for s in sizes:
        out = [prefix + (i,) for prefix in out for i in range(s)]
    return out

"""A simulated world: torch's LocalTensorMode holds every rank's shard in this one process and computes each
collective for all ranks at once (torch.distributed._local_tensor), on the fake process group. The real Trainer
runs once, over every rank's values; the few places where tessera's own Python differs by rank (the rows a rank
reads, its positions under cp, the region of a parameter it initializes) ask parallel/local_world.py and run once per
simulated rank. `trace` trains a layout so at its real world size, or one process (tests/test_simulated_world.py).

The cp ring, whose K/V passes are sends torch's LocalTensorMode takes only inside its LocalRunnerMode threads
(one per rank), runs every rank's ring steps here (parallel/context_simulated.py); the experts' all-to-all,
whose split sizes differ by rank, runs padded to equal splits (parallel/expert_simulated.py). A pipeline's
stages are different programs: each pp rank runs in a thread of its own, under a LocalTensorMode over its
stage's ranks, its messages and cross-stage all-reduces handled in this process (parallel/pipeline_simulated.py).
What it cannot run yet (refused by name in check_simulated): of cp, the all-gather method and packed documents."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from tessera.parallel.context_simulated import SIMULATED_DOCUMENTS
from tessera.parallel.local_world import per_rank, rank_int, swapped, world_disabled

from .local_dispatch import per_rank_dispatch_without_copies
from .simulated_shards import chunks_on_demand, uneven_shards_per_rank


def require_local_tensor() -> None:
    """ValueError naming the torch a simulated world needs, when this one lacks LocalTensorMode."""
    import torch  # lazy: (checked before a simulated run builds anything)

    try:
        # lazy: (as above)
        from torch.distributed._local_tensor import LocalTensorMode  # noqa: F401

        # earlier torches carry an earlier LocalTensorMode, not checked here (the GPU machines' 2.11)
        checked = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
    except (ImportError, ValueError):
        checked = False
    if not checked:
        raise ValueError(
            f"a simulated world needs torch 2.13 or later (its LocalTensorMode, torch.distributed._local_tensor, "
            f"is what was checked); this torch is {torch.__version__}: upgrade torch, or prove the layout on real "
            f"ranks (tessera.testing)"
        )


def uneven_shards(cfg: Any, layout: Any) -> list[str]:
    """The distinct tensors of `cfg` (a block's, on a tp rank, and the embedding's vocabulary rows) whose rows
    the FSDP ranks (dp_shard x cp) split unevenly, as `rows x cols`: FSDP2 pads their last shards (empty where
    the rows are fewer than the ranks), and the simulated world holds each rank's own (simulated_shards.py):
    what a proof of `layout` on `cfg` also covers."""
    from tessera.models.spec import spec_of  # lazy: (as in trace)
    from tessera.topology.shapes import layer_param_shapes

    fsdp = layout.dp_shard * layout.cp
    shape = spec_of(cfg).shape(cfg)
    shapes = dict.fromkeys([*layer_param_shapes(shape, layout.tp), (-(-shape.vocab_size // layout.tp), shape.dim)])
    return [f"{rows} x {cols}" for rows, cols in shapes if rows % fsdp or rows < fsdp]


def pipeline_layers(n_layers: int, pp: int, virtual: int = 1) -> int:
    """`n_layers`, or the fewest layers pp x virtual stages split evenly (a multiple of their count) where it
    has too few or an uneven split."""
    stages = pp * virtual
    return n_layers if n_layers >= stages and n_layers % stages == 0 else -(-n_layers // stages) * stages


def tp_vocab(vocab: int, tp: int) -> int:
    """`vocab` rounded up to a multiple of tp: each tp rank's vocabulary rows one size, which FSDP2 may then
    shard unevenly (check_simulated)."""
    return -(-vocab // tp) * tp


def sized_model(base: Any, layout: Any, virtual: int = 1) -> Any:
    """The smallest llama-family model like `base` (its GQA and MLP ratios; its layers, or the fewest that
    `virtual` stages per pp rank split evenly) that `layout` runs: `base` itself where tp splits its heads and
    widths, else the fewest parameters whose heads and widths tp splits; its vocabulary a multiple of tp. Its
    widths need not split over the FSDP ranks: the simulated world holds FSDP2's uneven and empty shards, as
    real ranks do."""
    import dataclasses  # lazy: (as above)

    from tessera.topology.shapes import check_tensor_parallel, kv_heads_fit  # lazy: (as above)

    tp = layout.tp
    group, ratio = base.n_heads // base.n_kv_heads, base.ffn_dim / base.dim
    base = dataclasses.replace(
        base, n_layers=pipeline_layers(base.n_layers, layout.pp, virtual), vocab_size=tp_vocab(base.vocab_size, tp)
    )
    options = [base]
    for head_dim in (16, 32, 64, 128):
        for n_kv in range(base.n_kv_heads, 4 * tp + 1):
            if not kv_heads_fit(n_kv, tp):
                continue
            n_heads = n_kv * group
            ffn = -(-int(ratio * n_heads * head_dim) // tp) * tp
            options.append(
                dataclasses.replace(base, dim=n_heads * head_dim, n_heads=n_heads, n_kv_heads=n_kv, ffn_dim=ffn)
            )
    # the base first, then the fewest parameters (a layer's matrices) first
    for cfg in options[:1] + sorted(options[1:], key=lambda c: c.dim * (2 * c.dim + 3 * c.ffn_dim)):
        try:
            check_tensor_parallel(cfg, tp)
        except ValueError:
            continue
        return cfg
    raise ValueError(f"no model of up to {4 * tp} kv heads splits over tp={tp}; name one with --model")


def sized_moe_model(base: Any, layout: Any, virtual: int = 1) -> Any:
    """The MoE model `base` with the fewest experts that ep splits (a multiple of ep, at least one per ep rank),
    its layers split over pp x `virtual` stages; its widths need not split over the FSDP ranks (sized_model)."""
    import dataclasses  # lazy: (as above)

    experts = -(-max(base.n_experts, layout.ep) // layout.ep) * layout.ep
    layers = pipeline_layers(base.n_layers, layout.pp, virtual)
    return dataclasses.replace(
        base, n_experts=experts, n_layers=layers, vocab_size=tp_vocab(base.vocab_size, layout.tp)
    )


# what a simulated run adds to the process beyond its tensors (the Trainer's modules, the allocator's pools, the
# one-process run after it): measured here as 137-153 MB of peak growth at 4-8 ranks of the debug model
RUN_BYTES = 160e6


def held_microbatches(schedule: Any, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The most microbatches' activations a pipeline rank holds at once, in whole-rank units (one unit: one
    microbatch through all of the rank's layers): the schedule's own peak of forwards not yet closed by their
    backward (their W where the kind splits it), over its pp x `virtual` stages. 1F1B: min(m, pp); GPipe and
    looped BFS: m; interleaved 1F1B with m > pp: more than pp (its warm-up runs ahead by up to a round).
    `schedule`: a kind's name, or the schedule as data (one row of Actions per rank)."""
    from tessera.topology.schedules.schedule import build_schedule, held_peak  # lazy: (as in trace)

    if isinstance(schedule, str):
        schedule = build_schedule(schedule, pp, microbatches, virtual)
    closes = "W" if any(a.op == "W" for row in schedule for a in row) else "B"
    return max(held_peak(row, "F", closes) for row in schedule) / virtual


def estimate_bytes(
    cfg: Any,
    layout: Any,
    seq_len: int,
    global_batch: int,
    microbatches: int = 1,
    schedule: Any = None,
    virtual: int = 1,
) -> float:
    """The memory a simulated world of a llama-family `cfg` holds at its peak, every rank's at once: the model's
    fp32 states (weight, gradient, AdamW's two moments) once per replica group; on each rank, FSDP2's gathered
    layers (two: the one computing and the one prefetched) and the embedding and output, with their unsharded
    gradients, and the largest gradient gathered whole for the comparison; each rank's activations (fp32, the
    attention's scores at the reference kernel's size); and the run's own modules and buffers (RUN_BYTES).
    Measured against the growth of the process's peak (bench_simulated_world.py): 0.14-7.4 GB at 4-512 ranks,
    within -3..+21% of it; tests/test_simulated_world.py holds it at 4 ranks. `microbatches`: the step's
    gradient-accumulation steps (the activations of one, or of the pipeline's in flight, are held at once);
    `schedule` and `virtual`: a pp layout's, whose held activations held_microbatches counts (None: 1F1B's
    min(m, pp))."""
    from tessera.models.spec import spec_of  # lazy: (as in trace)
    from tessera.topology.shapes import layer_param_shapes

    shape = spec_of(cfg).shape(cfg)
    layer, params = shape.block_params(), shape.num_params()
    ends = params - cfg.n_layers * layer  # the embedding, the output and the final norm
    states = 16 * params * layout.dp_replicate
    gathered = 8 * (2 * layer + ends) / layout.tp
    # the rows a rank holds activations of at once, on its layers (a pp rank's 1 / pp of them): one microbatch,
    # or under pp as many as its schedule holds at its peak
    held: float = 1
    if layout.pp > 1:
        held = (
            min(microbatches, layout.pp)
            if schedule is None
            else held_microbatches(schedule, layout.pp, microbatches, virtual)
        )
    rows = global_batch / (layout.dp_replicate * layout.dp_shard) / microbatches * held / layout.pp
    tokens = rows * seq_len / layout.cp
    # a token's MLP width: the dense one, or its top_k experts' (each padded no wider: simulated dispatch)
    ffn = getattr(cfg, "ffn_dim", 0) or 2 * cfg.top_k * cfg.moe_ffn_dim
    per_token = cfg.n_layers * (12 * cfg.dim + 4 * ffn / layout.tp) + 3 * cfg.vocab_size / layout.tp
    scores = cfg.n_layers * 3 * rows * cfg.n_heads / layout.tp * (seq_len / layout.cp) * seq_len
    # the comparison gathers each gradient whole on every rank, one parameter at a time: the largest's
    largest = 4 * max([cfg.vocab_size * cfg.dim] + [r * c for r, c in layer_param_shapes(shape, 1)])
    return RUN_BYTES + states + layout.world_size * (gathered + largest + 4 * (tokens * per_token + scores))


def available_bytes() -> float:
    """The memory this machine can give a new run now (/proc/meminfo's MemAvailable; inf where unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return float(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return float("inf")


@contextlib.contextmanager
def fsdp2_storage_per_rank() -> Iterator[None]:
    """FSDP2 frees and re-allocates a gathered parameter by resizing its storage; a LocalTensor's storage is
    its ranks' tensors', and resizing the wrapper raises (torch 2.13: "Attempted to call resize_() on an invalid
    python storage"). For the block, FSDP2's two helpers resize each simulated rank's tensor instead."""
    # lazy: FSDP2's internals, patched only around a simulated run
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group
    from torch.distributed._local_tensor import LocalTensor

    alloc, free = fsdp_param.alloc_storage, fsdp_param.free_storage

    def each(helper: Callable[[Any], None]) -> Callable[[Any], None]:
        def run(tensor: Any) -> None:
            for t in tensor._local_tensors.values() if isinstance(tensor, LocalTensor) else (tensor,):
                helper(t)

        return run

    with (
        swapped(fsdp_param, alloc_storage=each(alloc), free_storage=each(free)),
        swapped(fsdp_group, alloc_storage=each(alloc)),
    ):
        yield


@contextlib.contextmanager
def mesh_coordinates_once() -> Iterator[None]:
    """torch 2.13's LocalTensorMode finds every rank's coordinate in a new mesh (FSDP2 and DTensor slice them
    all along) by re-deriving the mesh's whole rank tensor once per rank, each op dispatched through the mode:
    O(world^2) work, 46 of the 83 s of a 64-rank check. For the block, the rank tensor is derived once, outside
    the mode, and read for every rank; the coordinates are the same (the same remap, the same uniqueness
    check). They are cached by mesh, holding the mesh: torch's own cache is keyed by id(mesh) alone, so a mesh
    freed mid-run (a slice FSDP2 or DTensor made) can hand its id, and its coordinates, to a new mesh of
    another shape (seen once in the suite: an IndexError in DTensor's shard offsets at dp4 x tp2 x ep4; torch's
    issue pytorch/pytorch#184526, fixed upstream by #187052, after the 2.13.0 wheel this project pins)."""
    # lazy: torch's simulated world, patched only around a simulated run
    from torch.distributed._local_tensor import LocalIntNode, _LocalDeviceMesh, enabled_local_tensor_mode

    known: dict[tuple[int, int], tuple[Any, Any, list[Any]]] = {}

    def get_coordinate(mesh: Any) -> list[Any]:
        import torch  # lazy: (as in trace)

        lm = enabled_local_tensor_mode()
        if lm is None:
            raise AssertionError("Unexpectedly not in LocalTensorMode")
        held = known.get((id(mesh), id(lm)))  # a simulated pipeline's stages: a mode per thread, its own ranks
        if held is not None and held[0] is mesh and held[1] is lm:
            return held[2]
        with lm._coordinate_cache_lock, lm.disable():
            ranks = mesh._layout.remap_to_tensor(mesh._rank_map.clone())
            sizes = tuple(ranks.shape[1:])
            rows = ranks.reshape(ranks.shape[0], -1).tolist()
        where: dict[int, list[int]] = {}
        for row in rows:
            for flat, rank in enumerate(row):
                where.setdefault(rank, []).append(flat)
        coords: list[dict[int, int]] = [{} for _ in sizes]
        for rank in lm.ranks:
            if len(where.get(rank, ())) != 1:  # torch's own check: each rank once in the mesh's layout
                raise AssertionError(f"rank {rank} is {len(where.get(rank, ()))} times in the mesh")
            flat = where[rank][0]
            for d in reversed(range(len(sizes))):
                flat, coords[d][rank] = divmod(flat, sizes[d])
        out = [torch.SymInt(LocalIntNode(c)) for c in coords]
        known[(id(mesh), id(lm))] = (mesh, lm, out)  # both held: their ids stay their own while the run lasts
        return out

    with swapped(_LocalDeviceMesh, get_coordinate=staticmethod(get_coordinate)):
        yield


@contextlib.contextmanager
def mesh_groups_once() -> Iterator[None]:
    """A DeviceMesh built under LocalTensorMode holds its rank tensor as a LocalTensor (every simulated rank's
    copy, all equal), and builds each dimension's process groups by iterating it: every row unbound and listed
    once per simulated rank, O(world^2) (14 of a 256-rank check's 198 s, profiled). For the block, the groups
    are built from one copy, outside the mode: the same rows, the same new_group calls in the same order."""
    import torch  # lazy: (as in trace)
    from torch.distributed._local_tensor import LocalTensor  # lazy: torch's simulated world, patched only here
    from torch.distributed.device_mesh import DeviceMesh

    build = DeviceMesh.__dict__["_init_one_process_group"]

    def init_one_process_group(sub_layout: Any, rank_map: Any, *rest: Any) -> Any:
        if not isinstance(rank_map, LocalTensor):
            return build.__func__(sub_layout, rank_map, *rest)
        copies = list(rank_map._local_tensors.values())
        with world_disabled():
            if all(torch.equal(copies[0], c) for c in copies[1:]):
                return build.__func__(sub_layout, copies[0], *rest)
        return build.__func__(sub_layout, rank_map, *rest)  # ranks that see different meshes: torch's own

    with swapped(DeviceMesh, _init_one_process_group=staticmethod(init_one_process_group)):
        yield


@contextlib.contextmanager
def regions_per_rank() -> Iterator[None]:
    """models/init.py's local_region asks DTensor's compute_local_shape_and_global_offset for the region a rank
    holds; under LocalTensorMode its per-shard steps run once per simulated rank through the mode, each
    building index tensors (20 of a 256-rank check's 52 s of set-up, profiled). For the block, torch's own
    function computes each rank's region from that rank's plain coordinate, outside the mode, and the ranks'
    answers become one int per rank: the same function, the same values."""
    import tessera.models.init as model_init  # lazy: (as in trace)
    from torch.distributed._local_tensor import _map_to_rank_local_val
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    region = model_init.local_region

    def local_region(p: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        coordinate = list((p.device_mesh.get_coordinate() or ()) if isinstance(p, DTensor) else ())
        by_rank = [per_rank(c) for c in coordinate]
        ranks = next((sorted(b) for b in by_rank if b is not None), None)
        if ranks is None:  # not a DTensor, or every rank at one coordinate: the function as it is
            return region(p)
        sizes, offsets = {}, {}
        with world_disabled():
            for r in ranks:
                at = [_map_to_rank_local_val(c, r) for c in coordinate]  # a per-rank, constant or plain int
                sizes[r], offsets[r] = _compute_local_shape_and_global_offset(
                    tuple(p.shape), tuple(p.device_mesh.shape), at, p.placements
                )
        offset = tuple(rank_int({r: offsets[r][d] for r in ranks}) for d in range(p.dim()))
        return offset, tuple(rank_int({r: sizes[r][d] for r in ranks}) for d in range(p.dim()))

    with swapped(model_init, local_region=local_region):
        yield


def check_simulated(config: Any, world: int) -> None:
    """ValueError naming what a simulated world of `world` ranks cannot run of `config`, before anything is
    built: a world that is not the layout's, packed documents under cp (not run yet), a vocabulary tp splits
    unevenly under FSDP, a torch without LocalTensorMode."""
    layout = config.layout
    if world != layout.world_size:
        raise ValueError(f"world={world} is not the world of {layout} ({layout.world_size} ranks)")
    if layout.cp > 1 and config.data.pack_documents:
        raise ValueError(f"pack_documents=True with cp={layout.cp}: {SIMULATED_DOCUMENTS}")
    vocab = config.model_config.vocab_size
    if vocab % layout.tp and layout.dp_shard * layout.cp > 1:
        # each tp rank's rows a size per rank, which FSDP2's own chunking (torch.chunk, before any patch) compares
        raise ValueError(
            f"vocab_size={vocab} splits unevenly over tp={layout.tp}, and FSDP2 shards those rows again: the "
            f"simulated world holds uneven FSDP2 shards of even tp shards only; use vocab_size="
            f"{-(-vocab // layout.tp) * layout.tp} (or a layout without FSDP ranks)"
        )
    require_local_tensor()


def trace(config: Any, world: int) -> dict[str, Any]:
    """{"losses", "grad_norms", "grads", "compute_dtypes", "flops_by_dtype", "build_s", "steps_s"} of `config`
    trained for its steps on `world` simulated ranks (1: one process) in this process, on the fake process
    group: each step's loss and grad norm, its gradients before clipping, whole, by their one-process names,
    each step's recorded matmul dtype and step 1's matmul FLOPs by dtype, and the seconds building the Trainer
    and training."""
    import torch  # lazy: a simulated run needs torch (tessera check's parser does not)
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.tensor import DTensor

    from tessera.models.init import one_process_name
    from tessera.parallel.pipeline_simulated import (
        SimulatedPipeline,
        modes_per_thread,
        stage_crossing_collectives,
        stage_ranks,
    )

    from .training_loop import Trainer

    if dist.is_initialized():
        raise RuntimeError("a simulated world runs in a process with no process group of its own")
    if world > 1:
        check_simulated(config, world)
    # gathering FSDP-over-tp gradients whole makes DTensor note its two all-gathers once per parameter
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("fake", rank=0, world_size=world)

    def train() -> dict[str, Any]:
        """This world's (or pipeline stage's) Trainer built and trained for the config's steps."""
        out: dict[str, Any] = {"losses": [], "grad_norms": [], "grads": [], "compute_dtypes": [], "flops": {}}
        started = time.perf_counter()
        trainer = Trainer(config, torch.device("cpu"), mesh=config.layout.build_mesh("cpu"))
        built = time.perf_counter()

        def keep(parts: list) -> None:
            step: dict[str, torch.Tensor] = {}
            for part in parts:
                for name, p in part.named_parameters():
                    g = p.grad
                    full = torch.zeros(p.shape) if g is None else (g.full_tensor() if isinstance(g, DTensor) else g)
                    if isinstance(full, LocalTensor):  # every simulated rank holds it whole: one rank's copy
                        with world_disabled():
                            full = next(iter(full._local_tensors.values()))
                    step[one_process_name(name)] = full.detach().clone()
            out["grads"].append(step)

        for _ in range(config.runtime.steps):
            record = trainer.train_step(on_grads=keep).record()
            out["losses"].append(float(record["loss"]))
            out["grad_norms"].append(float(record["grad_norm"]))
            out["compute_dtypes"].append(str(record.get("compute_dtype")))  # the dtype probe's
            out["flops"] = out["flops"] or dict(record.get("matmul_flops_by_dtype") or {})
        out["clock"] = (started, built, time.perf_counter())  # a pipeline's stages interleave: read together
        return out

    layout = config.layout
    try:
        with (
            warnings.catch_warnings(),
            mesh_coordinates_once(),
            mesh_groups_once(),
            regions_per_rank(),
            fsdp2_storage_per_rank(),
            chunks_on_demand(),
            uneven_shards_per_rank(),
            per_rank_dispatch_without_copies(),
        ):
            # the fake backend takes no timeout (each collective is computed here, nothing waits)
            warnings.filterwarnings("ignore", message="Set timeout is now only supported")
            if world == 1:
                ran = [train()]
            elif layout.pp == 1:
                with LocalTensorMode(world):
                    ran = [train()]
            else:  # a thread per pp rank, each simulating its stage's ranks (parallel/pipeline_simulated.py)
                pipeline = SimulatedPipeline(stage_ranks(layout))

                def stage(p: int) -> dict[str, Any]:
                    with LocalTensorMode(frozenset(pipeline.stage_ranks[p])):
                        return train()

                with modes_per_thread(), stage_crossing_collectives():
                    ran = pipeline.run(stage)
    finally:
        dist.destroy_process_group()
    first = ran[0]  # the loss and grad norm are reduced over pp: every stage's are the run's
    losses, norms, dtypes = first["losses"], first["grad_norms"], first["compute_dtypes"]
    grads = [{name: g for part in ran for name, g in part["grads"][k].items()} for k in range(len(first["grads"]))]
    flops_by_dtype: dict = {}
    for part in ran:  # a stage's matmuls are its layers': the model's are every stage's
        for dtype, flops in part["flops"].items():
            flops_by_dtype[dtype] = flops_by_dtype.get(dtype, 0) + flops
    # from the first stage's start to the last one built (the stages build in turn), then to the last one done
    began, built, ended = (f([part["clock"][i] for part in ran]) for i, f in enumerate((min, max, max)))
    seconds = {"build_s": built - began, "steps_s": ended - built}
    return {
        "losses": losses,
        "grad_norms": norms,
        "grads": grads,
        "compute_dtypes": dtypes,
        "flops_by_dtype": flops_by_dtype,
        **seconds,
    }

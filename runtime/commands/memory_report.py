"""`tessera memory`: per-rank model-state memory under ZeRO stages 0-3 and FSDP2 strategies, from a parameter
count or a preset; --dry-run builds the preset on the fake backend and counts the shards each rank holds."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from tessera.topology import Layout, memory
from tessera.topology.axes import AXIS, FLATTENED_BY_PURPOSE, TABLE, degrees_from_flags, values_of
from tessera.topology.estimators.fp8_model import FP8_RECIPES, fp8_summary
from tessera.topology.memory import get_recipe
from tessera.topology.estimators.muon_memory import MUON_RECIPES, muon_extra_bytes
from tessera.topology.estimators.rank_memory import rank_params_of
from tessera.training.run_config import said

from .plan import model_shape


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 70e9)") from None


def _memory_degrees(args: argparse.Namespace) -> dict[str, int]:
    """The degree of every axis of topology/axes.py's table from the memory command's flags (an axis it has
    no flag for is 1), by the table's one rule for flags (`degrees_from_flags`, as `tessera train` reads them)."""
    return degrees_from_flags({a.flag: getattr(args, a.flag, 1) for a in TABLE})


DRY_RUN_MAX_RANKS = 1 << 16  # memory --dry-run: the fake world's mesh is built in full (65,536 ranks: about 15 s)
# memory's degrees and their product: 1,048,576 ranks is beyond any job (--dp 1000000000000 printed 0.00 GB)
MAX_DEGREE = 1 << 20


def _degree(text: str) -> int | str:
    """A degree flag's value of `tessera memory`: an int, else its text as given, which `_memory_checks` refuses
    in one line naming it (argparse's own refusal is a usage block)."""
    try:
        return int(text)
    except ValueError:
        return text


def _memory_degree_flags(args: argparse.Namespace) -> None:
    """Each degree flag of `tessera memory` is a whole number of ranks: ValueError naming the flag, the value
    and the fix for a float (1e12) or other text, a count that is not positive, or more ranks than MAX_DEGREE."""
    for flag in (a.flag for a in TABLE if hasattr(args, a.flag)):  # the axes memory has a flag for
        value = getattr(args, flag)
        option = "--" + flag.replace("_", "-")
        if not isinstance(value, int):
            raise ValueError(f"{option} {value} must be a whole number of ranks, e.g. {option} 8")
        if value < 1:
            raise ValueError(f"{option} {value} must be a positive integer; use {option} 1 or more")
        if value > MAX_DEGREE:
            raise ValueError(
                f"{option} {value:,} is more ranks than any job has (at most {MAX_DEGREE:,}, 2**20, on one axis); "
                f"give the job's own degree, e.g. {option} 256"
            )


def _memory_checks(args: argparse.Namespace) -> dict[str, int]:
    """Every input of `tessera memory`, before anything is printed: ValueError naming the flag and the fix.
    Sets args.params from --model; returns the degrees of the axes."""
    _memory_degree_flags(args)
    if args.params is not None and args.model is not None:
        raise ValueError(
            f"give --params N or --model PRESET, not both (--model {args.model} has its own parameter count): drop one"
        )
    if args.params is None and args.model is None:
        raise ValueError("give --params N or --model PRESET")
    if args.params is not None and not (math.isfinite(args.params) and args.params > 0):
        raise ValueError(f"--params {args.params:g} must be a positive parameter count, e.g. --params 70e9")
    if args.gpu_memory is not None and not (math.isfinite(args.gpu_memory) and args.gpu_memory > 0):
        raise ValueError(
            f"--gpu-memory {args.gpu_memory:g} must be a positive number of GB per GPU, e.g. --gpu-memory 80"
        )
    recipe = memory.get_recipe(args.recipe)  # its ValueError names the recipes
    if args.model is None and getattr(args, "ep", 1) > 1:  # --params counts a model without experts
        raise ValueError(
            f"--ep {args.ep} splits a model's experts, and --params {args.params:g} names no experts; give --model "
            f"PRESET (an MoE one) instead of --params, or drop --ep"
        )
    if args.dry_run and args.model is None:
        raise ValueError(
            "--dry-run needs --model PRESET (it builds that model on the meta device); drop --dry-run "
            "or give --model instead of --params"
        )
    degrees = _memory_degrees(args)
    world = math.prod(d for name, d in degrees.items() if not AXIS[name].borrows)  # ep borrows its ranks
    if world > MAX_DEGREE:
        counted = {n for b in TABLE for n in b.counts if n != b.name}  # dp_replicate: --dp counts it
        given = " x ".join(
            f"{a.option} {getattr(args, a.flag)}"
            for a in TABLE
            if getattr(args, a.flag, 1) > 1 and a.name not in counted and not a.borrows
        )
        raise ValueError(
            f"{given} is {world:,} ranks, more than any job has (at most {MAX_DEGREE:,}, 2**20); give the job's "
            f"own degrees"
        )
    if args.dry_run and world > DRY_RUN_MAX_RANKS:
        raise ValueError(
            f"--dry-run builds the mesh of every fake rank, and {world:,} ranks are too many for one process "
            f"(at most {DRY_RUN_MAX_RANKS:,}); drop --dry-run for the analytic table"
        )
    if args.model is not None:
        shape = model_shape(args.model)  # an unknown preset: its ValueError names the presets
        _memory_shape_checks(args.model, shape, degrees)
        from tessera.models import get_preset  # lazy: torch stays out of `tessera memory --params`

        args.params = float(get_preset(args.model).num_params())
    total = args.params * recipe.bytes_per_param
    if not math.isfinite(total):
        raise ValueError(f"--params {args.params:g} is too large: its model states overflow a float; give a real count")
    if args.gpu_memory is not None and not math.isfinite(total / (args.gpu_memory * memory.GB)):
        raise ValueError(f"--gpu-memory {args.gpu_memory:g} is too small to count GPUs with; give GB per GPU, e.g. 80")
    return degrees


def _memory_shape_checks(model: str, shape, degrees: dict[str, int]) -> None:
    """The rules of topology/axes.py's table that the preset's shape decides (tp divides the heads, pp at most
    the layers, ...): ValueError naming the flag, the preset's value and the degrees that work."""
    values = values_of(shape)
    for a in TABLE:
        broken = a.problems(degrees, values)
        if not broken:
            continue
        limit = min(max([v for v in values.values() if isinstance(v, int) and not isinstance(v, bool)] + [1]), 1 << 16)
        good = [d for d in range(1, limit + 1) if not a.problems({**degrees, a.name: d}, values)]
        if good and good == list(range(1, good[-1] + 1)) and len(good) > 8:
            use = f"{a.option} 1 to {good[-1]}"
        elif good:
            use = f"{a.option} " + (", ".join(map(str, good[:-1])) + " or " if len(good) > 1 else "") + str(good[-1])
        else:
            use = f"another {a.option}"
        rule, _, given = broken[0].partition("; ")
        raise ValueError(
            f"{a.option} {degrees[a.name]} does not fit the {model} preset ({given.replace(';', ',')}): "
            f"{rule}; use {use}"
        )


def _gb(nbytes: float) -> str:
    """Decimal GB as topology.memory.gigabytes writes them, with the unit."""
    return f"{memory.gigabytes(nbytes)} GB"


def _memory_table(num_params: float, dp: int, recipe: str) -> str:
    """topology.memory.memory_table's ZeRO table (its title line, its rows), with columns as wide as their
    widest cell: a figure of any size never runs into its neighbour."""
    stages = [memory.model_state_bytes(num_params, dp=dp, zero_stage=s, recipe=recipe) for s in range(4)]
    rows = {"": [f"ZeRO-{s}" for s in range(4)], "FSDP": ["NO_SHARD", "-", "SHARD_GRAD_OP", "FULL_SHARD"]}
    rows.update({c: [_gb(st[c]) for st in stages] for c in ("parameters", "gradients", "optimizer", "total")})
    width = max(15, 2 + max(len(cell) for cells in rows.values() for cell in cells))
    title = memory.memory_table(num_params, dp, recipe).splitlines()[0]
    return "\n".join(
        [title] + [f"{name:<12}" + "".join(f"{cell:>{width}}" for cell in cells) for name, cells in rows.items()]
    )


# the table's recipes count every parameter alike; under Muon they are not (topology/estimators/muon_memory.py)
MUON_NOTE = (
    "Muon recipe: every parameter above counts Muon's one momentum; the parameters AdamW keeps (embeddings, head, "
    "norms, routers) hold Adam's two moments, and a matrix's owner gathers it whole at the step: with --model the "
    "planner's line counts both, as tessera plan --optimizer muon does"
)


def _memory(args: argparse.Namespace) -> int:
    try:
        degrees = _memory_checks(args)  # every input, before any output
        # tp and pp split the model (evenly, in this analytic view; --dry-run counts exactly); FSDP / ZeRO
        # shards what a rank holds over dp_shard x cp; dp_replicate holds copies
        sharding = FLATTENED_BY_PURPOSE["fsdp"].axes  # dp_shard x cp
        splitting = [
            a.name
            for a in reversed(TABLE)  # tp, pp: the axes of their own ranks that split the model
            if not a.borrows and a.name not in sharding and {"layers", "parameters"} & set(a.shards)
        ]
        split = math.prod(degrees[n] for n in splitting)
        shard_group = math.prod(degrees[n] for n in sharding)
        per_rank_params = args.params / split
        exact = _planner_model_states(args, shard_group) if args.model is not None else None
        fp8 = _fp8_summary(args, degrees["tp"], shard_group)
        floor = None
        if args.gpu_memory is not None:
            floor = math.ceil(
                args.params * memory.get_recipe(args.recipe).bytes_per_param / (args.gpu_memory * memory.GB) - 1e-9
            )
        if args.json:
            rows: dict[str, Any] = {
                f"zero{s}": memory.model_state_bytes(per_rank_params, dp=shard_group, zero_stage=s, recipe=args.recipe)
                for s in range(4)
            }
            rows["layout"] = {**degrees, "params_per_model_shard": per_rank_params, "shard_group": shard_group}
            if floor is not None:
                rows["min_gpus"] = floor
            if exact is not None:
                rows["planner_zero3"] = exact
            if args.recipe in MUON_RECIPES:
                rows["note"] = MUON_NOTE
            if fp8 is not None:
                rows["fp8"] = fp8
            if args.fault_tolerant:
                rows["fault_tolerant"] = _fault_tolerant_bytes(per_rank_params, shard_group)
            if args.offload != "none":  # where each stage's states live under --offload
                rows["offload"] = {
                    "mode": args.offload,
                    **{
                        f"zero{st}": memory.offload_split(rows[f"zero{st}"], args.offload, args.recipe)
                        for st in range(4)
                    },
                }
            print(json.dumps(rows))
        else:
            if split > 1 or shard_group != args.dp:
                print(
                    f"layout {' x '.join(f'{n}{d}' for n, d in degrees.items())}: {' x '.join(splitting)} split the "
                    f"model {split} ways ({memory.parameter_count(per_rank_params)} parameters each, evenly: --dry-run "
                    f"counts exactly); ZeRO shards over {' x '.join(sharding)} = {shard_group} ranks"
                )
            print(_memory_table(per_rank_params, shard_group, args.recipe))
            if args.recipe in MUON_RECIPES:
                print(MUON_NOTE)
            if floor is not None:
                total = args.params * memory.get_recipe(args.recipe).bytes_per_param
                gpus = floor if floor < 10**12 else f"{floor:.3e}"
                print(
                    f"raw floor: {gpus} GPUs of {args.gpu_memory:g} GB hold the {_gb(total)} of model states "
                    f"(fully sharded, before activations and buffers)"
                )
            if exact is not None:
                print(
                    f"the planner's count (tessera plan), FULL_SHARD, the rank holding the most (embedding or head, "
                    f"K/V replicated beyond the kv heads): {exact['parameters_on_rank']:,} parameters, "
                    f"{_gb(exact['total'])} of model states"
                    + (
                        f" (Muon: Adam's moments on the parameters AdamW keeps, and {exact['muon_gathered'] / 1e9:.2f} "
                        f"GB of the largest matrix gathered whole at the step)"
                        if "muon_gathered" in exact
                        else ""
                    )
                )
            if fp8 is not None:
                print(_fp8_line(args.fp8, fp8))
            if args.offload != "none":
                print(_offload_line(args.offload, per_rank_params, shard_group, args.recipe))
            if args.fault_tolerant:
                print(_fault_tolerant_line(per_rank_params, shard_group))
        if args.dry_run:
            _memory_dry_run(args)
    except ValueError as e:
        print(f"tessera memory: error: {said(e, args)}", file=sys.stderr)
        return 2
    return 0


def _fault_tolerant_bytes(params: float, shard_group: int) -> dict[str, float]:
    """--fault-tolerant's extra bytes per rank (parallel/fault_tolerance.py, parallel/replica_transport.py), of
    the FULL_SHARD shard: the all-reduce's weighted fp32 gradient copies and their flat buffer on the device
    (8 B an element), and a recovery's host copies on the sending and the receiving rank (the state's tensors,
    12 B an element for fp32 weights and AdamW's moments, and their encoded bytes, 12 more)."""
    local = params / shard_group
    return {"device_reduce_buffer_bytes": 8 * local, "host_recovery_bytes": 24 * local}


def _fault_tolerant_line(params: float, shard_group: int) -> str:
    b = _fault_tolerant_bytes(params, shard_group)
    return (
        f"--fault-tolerant, per rank (FULL_SHARD's shard): {_gb(b['device_reduce_buffer_bytes'])} of GPU for the "
        f"all-reduce between replica groups (weighted fp32 gradient copies and their flat buffer), "
        f"{_gb(b['host_recovery_bytes'])} of host memory while a rejoining group receives its state"
    )


def _offload_line(mode: str, params: float, shard_group: int, recipe: str) -> str:
    """Where --offload puts a rank's states, per ZeRO stage: on the GPU and in host memory."""
    cells = []
    for st in range(4):
        split = memory.offload_split(
            memory.model_state_bytes(params, dp=shard_group, zero_stage=st, recipe=recipe), mode, recipe
        )
        cells.append(f"ZeRO-{st} {_gb(split['device']['total'])} GPU + {_gb(split['host']['total'])} host")
    what = (
        "the moments, an fp32 copy of each shard and a gradient buffer on the host"
        if mode == "optimizer"
        else "parameters, gradients and optimizer state on the host (FSDP2's CPUOffloadPolicy)"
    )
    return f"--offload {mode} ({what}), per rank: " + "; ".join(cells)


def _fp8_summary(args: argparse.Namespace, tp: int, shard_group: int) -> dict[str, float] | None:
    """--fp8's figures for the preset (topology/estimators/fp8_model.py), None without --fp8; it needs --model's
    shape."""
    if args.fp8 is None:
        return None
    if args.fp8 not in FP8_RECIPES:
        raise ValueError(f"--fp8 {args.fp8!r}: use one of {', '.join(FP8_RECIPES)}")
    if args.model is None:
        raise ValueError("--fp8 needs --model PRESET (which linear layers run in FP8 is the model's shape)")
    return fp8_summary(model_shape(args.model), args.fp8, tp, shard_group)


def _fp8_line(recipe: str, f: dict[str, float]) -> str:
    gather = (
        f"FSDP2 all-gathers them in FP8: {_gb(f['all_gather_bytes_per_gather'])} a gather per rank against "
        f"{_gb(f['all_gather_bytes_per_gather_without_fp8'])} in bf16"
        if f["all_gather_bytes_per_gather"] < f["all_gather_bytes_per_gather_without_fp8"]
        else "their all-gather stays bf16 (FP8 all-gather: tensorwise, FSDP2 without tp)"
    )
    return (
        f"--fp8 {recipe}: {f['fp8_params'] / 1e9:.2f}B of {f['params'] / 1e9:.2f}B parameters in FP8 linear layers "
        f"(their fp32 master weights, gradients and optimizer state as above); {gather}; the casts move "
        f"{f['cast_bytes_per_token'] / 1e6:.2f} MB per token and {_gb(f['cast_bytes_of_weights_per_microbatch'])} "
        f"of weights per microbatch through memory"
    )


def _planner_model_states(args: argparse.Namespace, shard_group: int) -> dict:
    """ZeRO-3 model states per rank as the planner counts them: exact per-rank parameters of the rank that
    holds the most, the same recipe (topology.memory) as the table."""
    cfg = model_shape(args.model)
    if args.pp > cfg.n_layers:
        raise ValueError(f"--pp {args.pp} exceeds the {args.model} preset's {cfg.n_layers} layers")
    ep = _memory_degrees(args).get("ep", 1)
    # the pp rank holding the most (the embedding's or the head's), as planner.rank_params picks it
    by_rank = {p: rank_params_of(cfg, args.tp, args.pp, 1, shard_group, p, ep) for p in sorted({0, args.pp - 1})}
    pp_rank = max(by_rank, key=lambda p: by_rank[p][0])
    sharded = by_rank[pp_rank][1]
    r = get_recipe(args.recipe)
    out = {c: float(sharded * getattr(r, c)) for c in ("parameters", "gradients", "optimizer")}
    if args.recipe in MUON_RECIPES:  # AdamW's parameters keep Adam's second moment; an owner's gathered matrix
        moment, out["muon_gathered"] = muon_extra_bytes(cfg, args.recipe, args.tp, args.pp, 1, shard_group, pp_rank, ep)
        out["optimizer"] += moment
    return {**out, "total": sum(out.values()), "parameters_on_rank": sharded}


def _memory_dry_run(args: argparse.Namespace) -> None:
    from tessera.parallel.parallelize import dry_run_model_states  # lazy: torch, for --dry-run only

    if args.model is None:
        raise ValueError("--dry-run needs --model PRESET (it builds that model on the meta device)")
    layout = Layout(**_memory_degrees(args))
    if args.pp > 1:
        from tessera.models import get_preset  # lazy: torch, for --dry-run only

        if args.pp > get_preset(args.model).n_layers:
            raise ValueError(
                f"--pp {args.pp} exceeds the {args.model} preset's {get_preset(args.model).n_layers} layers"
            )
        _memory_per_stage(args, layout)
        return
    # expert parallel borrows dp_shard x cp, which NO_SHARD moves to dp_replicate: no NO_SHARD row under ep
    for strategy in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD") if layout.ep == 1 else ("SHARD_GRAD_OP", "FULL_SHARD"):
        m = dry_run_model_states(args.model, layout, args.recipe, strategy)
        print(
            f"dry run, {args.model} on {layout.world_size} fake ranks ({layout}), {strategy:<13}: "
            f"{m['local_params'] / 1e6:,.1f}M parameters on rank 0; model states "
            + " + ".join(f"{m[c] / 1e9:.2f}" for c in ("parameters", "gradients", "optimizer"))
            + f" = {m['total'] / 1e9:.2f} GB per rank"
        )


def _memory_per_stage(args: argparse.Namespace, layout) -> None:
    """One line per pipeline stage: its layers, its parameters, and a rank's model states (FULL_SHARD)."""
    from tessera.parallel.parallelize import dry_run_model_states  # lazy: torch, for --dry-run only

    print(f"dry run, {args.model} on {layout.world_size} fake ranks ({layout}), FULL_SHARD, per pipeline stage:")
    for stage in range(args.pp):
        rank = layout.rank_of({"pp": stage})
        m = dry_run_model_states(args.model, layout, args.recipe, "FULL_SHARD", rank=rank)
        first, last = m["layers"][0]
        extras = (["embedding"] if stage == 0 else []) + (["norm + head"] if stage == args.pp - 1 else [])
        print(
            f"  stage {stage}: layers {first}-{last - 1}{' + ' + ', '.join(extras) if extras else ''}, "
            f"{m['stage_params'] / 1e9:.2f}B parameters; {m['local_params'] / 1e6:,.1f}M on each of its ranks; "
            f"model states "
            + " + ".join(f"{m[c] / 1e9:.2f}" for c in ("parameters", "gradients", "optimizer"))
            + f" = {m['total'] / 1e9:.2f} GB per rank"
        )


def add_memory_parser(sub: argparse._SubParsersAction) -> None:
    mem = sub.add_parser("memory", help="per-rank model-state memory under ZeRO stages 0-3")
    mem.add_argument("--params", type=_float, default=None, help="parameter count, e.g. 70e9")
    mem.add_argument("--model", default=None, help="a model preset (its parameter count, and --dry-run)")
    # the degrees: _degree keeps a value that is no int as its text, which _memory_checks refuses in one line
    mem.add_argument("--tp", type=_degree, default=1, metavar="N", help="tensor-parallel degree (splits the model)")
    mem.add_argument(
        "--pp",
        type=_degree,
        default=1,
        metavar="N",
        help="pipeline stages (split the model; --dry-run: per-stage figures)",
    )
    mem.add_argument(
        "--cp", type=_degree, default=1, metavar="N", help="context-parallel degree (FSDP shards over dp_shard x cp)"
    )
    mem.add_argument(
        "--dp-replicate", type=_degree, default=1, metavar="N", help="HSDP replicas: --dp = dp_replicate x dp_shard"
    )
    mem.add_argument(
        "--ep",
        type=_degree,
        default=1,
        metavar="N",
        help="expert parallel (an MoE --model: its experts split over N of the dp_shard x cp ranks; --dry-run "
        "counts each rank's)",
    )
    mem.add_argument(
        "--dry-run",
        action="store_true",
        help="also build the preset on the fake backend and count the shards each rank holds",
    )
    mem.add_argument("--dp", type=_degree, default=1, metavar="N", help="data-parallel ranks sharing the model states")
    mem.add_argument("--recipe", default="mixed_adam", help="mixed_adam (2+2+12 B), fp32_adam (4+4+8 B), ...")
    mem.add_argument("--gpu-memory", type=_float, default=None, help="GB per GPU: also print the raw GPU floor")
    mem.add_argument("--json", action="store_true", help="print bytes as JSON instead of the table")
    mem.add_argument(
        "--fp8",
        default=None,
        metavar="tensorwise|rowwise",
        help="with --model: the parameters --fp8 runs in FP8, the all-gather bytes it saves, its casts' traffic",
    )
    mem.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="also print what tessera train --fault-tolerant adds: its all-reduce buffer and a recovery's host bytes",
    )
    mem.add_argument(
        "--offload",
        choices=("none", "optimizer", "params"),
        default="none",
        help="also print where tessera train --offload puts each stage's states: on the GPU and in host memory",
    )
    mem.set_defaults(func=_memory)

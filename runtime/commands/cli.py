"""The `tessera` command: train, memory, plan, bench, export, convert, tokenize (and --version)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from safetensors import SafetensorError
from tessera import __version__
from tessera.topology import Layout, memory
from tessera.topology.axes import AXIS, FLATTENED_BY_PURPOSE, TABLE, degrees_from_flags, values_of
from tessera.topology.errors import with_flags
from tessera.topology.memory import GB, get_recipe
from tessera.topology.planner import rank_params
from tessera.training.config import add_arguments, config_from_args, flag_names, parser_flags, said

from .bench import add_bench_parser
from .plan import add_plan_parser, model_shape


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
    """Decimal GB with two decimals; scientific notation from 10 million GB on, so a cell stays short."""
    return f"{nbytes / GB:.2f} GB" if nbytes / GB < 1e7 else f"{nbytes / GB:.3e} GB"


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
        floor = None
        if args.gpu_memory is not None:
            floor = math.ceil(
                args.params * memory.get_recipe(args.recipe).bytes_per_param / (args.gpu_memory * memory.GB) - 1e-9
            )
        if args.json:
            rows = {
                f"zero{s}": memory.model_state_bytes(per_rank_params, dp=shard_group, zero_stage=s, recipe=args.recipe)
                for s in range(4)
            }
            rows["layout"] = {**degrees, "params_per_model_shard": per_rank_params, "shard_group": shard_group}
            if floor is not None:
                rows["min_gpus"] = floor
            if exact is not None:
                rows["planner_zero3"] = exact
            print(json.dumps(rows))
        else:
            if split > 1 or shard_group != args.dp:
                print(
                    f"layout {' x '.join(f'{n}{d}' for n, d in degrees.items())}: {' x '.join(splitting)} split the "
                    f"model {split} ways ({per_rank_params / 1e9:g}B parameters each, evenly: --dry-run counts "
                    f"exactly); ZeRO shards over {' x '.join(sharding)} = {shard_group} ranks"
                )
            print(_memory_table(per_rank_params, shard_group, args.recipe))
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
                    f"{exact['total'] / 1e9:.2f} GB of model states"
                )
        if args.dry_run:
            _memory_dry_run(args)
    except ValueError as e:
        print(f"tessera memory: error: {said(e, args)}", file=sys.stderr)
        return 2
    return 0


def _planner_model_states(args: argparse.Namespace, shard_group: int) -> dict:
    """ZeRO-3 model states per rank as the planner counts them: exact per-rank parameters of the rank that
    holds the most, the same recipe (topology.memory) as the table."""
    cfg = model_shape(args.model)
    if args.pp > cfg.n_layers:
        raise ValueError(f"--pp {args.pp} exceeds the {args.model} preset's {cfg.n_layers} layers")
    _, sharded, _ = rank_params(cfg, args.tp, args.pp, 1, shard_group, _memory_degrees(args).get("ep", 1))
    r = get_recipe(args.recipe)
    out = {c: float(sharded * getattr(r, c)) for c in ("parameters", "gradients", "optimizer")}
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
    for strategy in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"):
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


def _export(args: argparse.Namespace) -> int:
    # lazy: tessera.parallel imports torch, which stays out of `tessera --help` and the torch-free commands
    from tessera.parallel.checkpoint import CheckpointError, export_checkpoint

    if (args.out is None) == (args.to_hf is None):
        print("tessera export: error: give one of --out FILE.safetensors or --to-hf DIR", file=sys.stderr)
        return 2
    target = args.out if args.out is not None else args.to_hf
    flag = "--out" if args.out is not None else "--to-hf"
    try:
        _check_out_path(flag, target, directory=args.to_hf is not None)
        if not args.checkpoint:
            raise CheckpointError(
                "the checkpoint '' is an empty path; name a checkpoint directory (or a --checkpoint-dir)"
            )
        if args.out is not None:
            manifest, written = export_checkpoint(args.checkpoint, args.out), ""
        else:
            manifest, architecture = _export_hf(args.checkpoint, args.to_hf)
            written = (
                f" (a Hugging Face {architecture} directory: transformers' {architecture}.from_pretrained loads it)"
            )
    except (CheckpointError, ValueError) as e:
        print(f"tessera export: error: {said(e, args)}", file=sys.stderr)
        return 2
    except OSError as e:  # writing the output (reading the checkpoint raises CheckpointError)
        print(
            f"tessera export: error: {flag} {target}: {e.strerror or e} ({e.filename or target}); choose another "
            f"path, or free space",
            file=sys.stderr,
        )
        return 2
    print(f"wrote {target}: model {manifest['model']['preset']} at step {manifest['step']}{written}")
    return 0


def _check_out_path(flag: str, target: str, directory: bool = False) -> None:
    """ValueError naming `flag` unless `target` can be written: a file (replaced atomically, so never a
    directory or a device) or, with `directory`, a directory, whose parent exists and is writable."""
    what = "the directory to write" if directory else "the .safetensors file to write"
    if not target:
        raise ValueError(f"{flag} '' is an empty path; name {what}")
    path = Path(target)
    if directory and path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {target} exists and is not a directory; name {what}")
    if not directory and path.is_dir():
        raise ValueError(f"{flag} {target} is a directory; name {what} (e.g. {target.rstrip('/')}/model.safetensors)")
    if not directory and path.exists() and not path.is_file():
        raise ValueError(f"{flag} {target} is not a regular file (a device or a pipe); name {what}")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {target}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {target}: directory {parent} is not writable; choose another")

    try:  # permission bits pass directories no one can write into (/proc, as root): write a file to know
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".tessera-write-check-"):
            pass
    except OSError as e:
        raise ValueError(
            f"{flag} {target}: directory {parent} cannot be written ({e.strerror}); choose another"
        ) from None


def _export_hf(checkpoint_path: str, directory: str) -> tuple[dict, str]:
    """Write the checkpoint's model as a Hugging Face directory of its family; (its manifest, the architecture
    class its config.json names: LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, ...)."""
    # lazy: tessera.models and tessera.parallel import torch, which stays out of the torch-free commands
    from tessera.models.hf import config_from_manifest, save_hf
    from tessera.models.spec import spec_of
    from tessera.parallel.checkpoint import export_checkpoint, read_safetensors

    with tempfile.TemporaryDirectory() as tmp:
        manifest = export_checkpoint(checkpoint_path, os.path.join(tmp, "full.safetensors"))
        state = read_safetensors(os.path.join(tmp, "full.safetensors"))
    cfg = config_from_manifest(manifest["model"])
    save_hf(state, cfg, directory)  # the family's HF adapter (a family without one: its ValueError)
    hf = spec_of(cfg).hf
    return manifest, hf.architecture if hf is not None else "transformers"


def _convert(args: argparse.Namespace) -> int:
    # lazy: tessera.models and tessera.parallel import torch, which stays out of the torch-free commands
    from tessera.models.hf import check_hf_weights, hf_weight_map, read_hf_config, read_hf_parameter
    from tessera.parallel.safe_io import write_safetensors

    try:
        _check_out_path("--out", args.out)
        cfg = read_hf_config(args.from_hf, flag="from_hf")  # the family from config.json's model_type
        check_hf_weights(args.from_hf, cfg, flag="from_hf")
        # tessera's names; a tied parameter once, under its owner's name
        tensors = {
            ours: read_hf_parameter(source) for ours, source in hf_weight_map(args.from_hf, cfg, flag="from_hf").items()
        }
    except ValueError as e:  # CheckpointError (a damaged safetensors file) included
        print(f"tessera convert: error: {said(e, args)}", file=sys.stderr)
        return 2
    except SafetensorError as e:  # a shard of an indexed checkpoint that is not safetensors
        print(
            f"tessera convert: error: --from-hf {args.from_hf}: a weight file is not safetensors "
            f"({str(e).splitlines()[0] if str(e) else 'damaged'})",
            file=sys.stderr,
        )
        return 2
    except OSError as e:
        print(
            f"tessera convert: error: --from-hf {args.from_hf}: {e.filename or args.from_hf} cannot be read "
            f"({e.strerror or e})",
            file=sys.stderr,
        )
        return 2
    try:
        write_safetensors(
            tensors, args.out, {"source": "huggingface", "family": cfg.family, "config": json.dumps(cfg.as_dict())}
        )
    except OSError as e:
        print(
            f"tessera convert: error: --out {args.out} cannot be written ({e.strerror or e}); choose another path, "
            f"or free space",
            file=sys.stderr,
        )
        return 2
    print(
        f"wrote {args.out}: {cfg.n_layers} layers, dim {cfg.dim}, {cfg.num_params() / 1e6:,.1f}M parameters in "
        f"tessera's names (train from it with --init-from-hf {args.from_hf}, "
        f"or --init-from {args.out} with a matching preset)"
    )
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    from .tokenize import tokenize  # lazy: it imports torch (tessera.models.tokens)

    try:
        written = tokenize(
            args.tokenizer, args.out, args.files, args.separator, args.field, args.shard_tokens, progress=not args.quiet
        )
    except (ValueError, OSError) as e:
        print(f"tessera tokenize: error: {said(e, args)}", file=sys.stderr)
        return 2
    from tessera.models.tokens import open_dataset  # lazy: tessera.models imports torch

    total = sum(len(s.tokens) for s in open_dataset(args.out))
    print(f"wrote {len(written)} shard(s), {total:,} tokens, to {args.out}: train on them with --data {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="4D-parallel transformer training on one DeviceMesh")
    parser.add_argument("--version", action="version", version=f"tessera {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

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
        "--dry-run",
        action="store_true",
        help="also build the preset on the fake backend and count the shards each rank holds",
    )
    mem.add_argument("--dp", type=_degree, default=1, metavar="N", help="data-parallel ranks sharing the model states")
    mem.add_argument("--recipe", default="mixed_adam", help="mixed_adam (2+2+12 B), fp32_adam (4+4+8 B), ...")
    mem.add_argument("--gpu-memory", type=_float, default=None, help="GB per GPU: also print the raw GPU floor")
    mem.add_argument("--json", action="store_true", help="print bytes as JSON instead of the table")
    mem.set_defaults(func=_memory)

    exp = sub.add_parser(
        "export",
        help="a checkpoint's model as one full safetensors file, or a Hugging Face directory (no ranks needed)",
    )
    exp.add_argument("checkpoint", help="a checkpoint directory, or a --checkpoint-dir with a latest pointer")
    exp.add_argument("--out", default=None, help="the .safetensors file to write (tessera's names)")
    exp.add_argument(
        "--to-hf",
        default=None,
        metavar="DIR",
        help="write a Hugging Face directory of the checkpoint's model family instead (config.json naming its "
        "architecture, e.g. LlamaForCausalLM, Qwen3ForCausalLM or Qwen3MoeForCausalLM; model.safetensors)",
    )
    exp.set_defaults(func=_export)

    conv = sub.add_parser(
        "convert",
        help="a Hugging Face directory (Llama, Qwen3: by config.json's model_type) to one "
        "safetensors file in tessera's names",
    )
    conv.add_argument(
        "--from-hf", required=True, metavar="DIR", help="config.json + model.safetensors (or sharded with an index)"
    )
    conv.add_argument("--out", required=True, help="the .safetensors file to write")
    conv.set_defaults(func=_convert)

    tok = sub.add_parser("tokenize", help="text or JSONL files to token files for --data (needs the data extra)")
    tok.add_argument("files", nargs="+", help=".txt files (one document each) or .jsonl files (one per line)")
    tok.add_argument(
        "--tokenizer", required=True, help="a tokenizer.json (Hugging Face tokenizers format); nothing is downloaded"
    )
    tok.add_argument("--out", required=True, help="the directory to write shard_NNNNN.bin/.json into")
    tok.add_argument(
        "--separator", default=None, help="the document separator token (default: the tokenizer's end-of-text token)"
    )
    tok.add_argument("--field", default="text", help="the JSONL field that holds the text (default: text)")
    tok.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default: 100,000,000)")
    tok.add_argument("--quiet", action="store_true", help="no progress bar")
    tok.set_defaults(func=_tokenize)

    add_plan_parser(sub)
    add_bench_parser(sub)

    tr = sub.add_parser(
        "train",
        help="train a model on a layout (spawns local ranks outside torchrun)",
        description="Train on a layout. Outside torchrun it spawns pp*dp*cp*tp local ranks (NCCL, one GPU per "
        "rank, on a machine with enough GPUs; gloo on CPU); under torchrun it joins the job, and the "
        "degrees not given are inferred from WORLD_SIZE (the rest to dp).",
    )
    add_arguments(tr)
    tr.set_defaults(func=_train)
    # each subcommand's parameters -> its flags, for the errors it prints (train: the config's fields too; a
    # subcommand may add the library's own names of its options, as plan does Hardware's gpu_memory_gb)
    for name, subparser in sub.choices.items():
        own = subparser.get_default("flags") or {}
        subparser.set_defaults(flags={**parser_flags(subparser), **own, **(flag_names() if name == "train" else {})})
    return parser


def _train(args: argparse.Namespace) -> int:
    # lazy: these import torch, which stays out of `tessera --help` and the torch-free commands
    from tessera.parallel.checkpoint import CheckpointError
    from tessera.parallel.launch import Interrupted, RankFailure
    from tessera.training.run import done_line, error_exit, failed_message, stopped_message, train, under_torchrun

    try:
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else None
        config = config_from_args(args, world)
        config.check()
        if world is not None:
            config.layout.check_world_size(world)
            if config.runtime.check_drift:
                raise ValueError(
                    "--check-drift trains one-process runs after this one: run it outside torchrun "
                    "(tessera train spawns the ranks), or check a torchrun job's records with "
                    "tessera.testing.judge_drift"
                )
    except ValueError as e:  # CheckpointError included
        return error_exit("train", said(e, args))
    try:
        history = train(config)
    except CheckpointError as e:  # raised before any rank starts (e.g. the checkpoint directory is in use)
        return error_exit("train", said(e, args))
    except (Interrupted, KeyboardInterrupt) as e:  # SIGTERM / Ctrl-C: every rank has been stopped
        why = str(e) or "stopped by SIGINT"
        error_exit("train", stopped_message(why, config))
        return 128 + (15 if "SIGTERM" in why else 2)
    except RankFailure as e:  # a rank's named failure (one of tessera's errors) becomes the command's one line
        if e.cause is not None and e.cause["tessera"]:
            error_exit("train", with_flags(e.cause["message"], args.flags))
            return e.cause["exit_code"]
        if e.cause is None or e.cause["type"] == "OutOfMemoryError":  # killed, or out of GPU memory: no bug
            error_exit("train", failed_message(e, config))
            return 1
        raise  # an unexpected exception in a rank: its traceback is the report
    if history and not config.runtime.quiet:
        print(done_line(history, config))
    if history and config.runtime.check_drift:
        return _check_drift(config, history)
    return 0


def _check_drift(config, history: list) -> int:
    """--check-drift: one process's own spread over microbatch counts, and this run judged against it."""
    from tessera.testing import drift_envelope, judge_drift  # lazy: tessera.testing imports torch

    counts = tuple(m for m in (1, 2, 4) if config.data.global_batch % m == 0)
    envelope = drift_envelope(config, counts)
    problems = judge_drift(history, envelope)
    widest = {k: max(row[k] for row in envelope["envelope"]) for k in ("loss", "grad_norm")}
    spread = (
        f"one process at microbatches {', '.join(map(str, counts))} spreads up to {widest['loss']:.1e} in loss "
        f"and {widest['grad_norm']:.1e} in grad norm"
    )
    if not problems:
        print(f"drift check: all {len(history)} steps within 2x one process's own spread ({spread})")
        return 0
    for line in problems:
        print(f"drift check: {line}")
    print(f"drift check: {len(problems)} of {2 * len(history)} figures beyond 2x one process's own spread ({spread})")
    return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code = int(args.func(args) or 0)
    if args.command == "train" and code == 0:
        from tessera.training.run import (
            under_torchrun,  # lazy: tessera.training.run imports torch (loaded by now: a train ran)
        )

        if under_torchrun():
            # a torchrun worker that finished its job ends the way the local launcher's ranks do
            # (multiprocessing leaves them with os._exit): the interpreter's teardown, after the process group
            # is destroyed, aborted about one run in ten here in a C++ destructor ("terminate called without
            # an active exception", SIGABRT) and failed a finished job. Everything is written and closed by
            # now. Not on an error: a rank that left at once would have torchrun kill rank 0 before it prints
            # the job's one error line.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())

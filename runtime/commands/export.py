"""`tessera export` (a checkpoint to one safetensors file or a Hugging Face directory) and `tessera convert` (a
Hugging Face directory to one safetensors file in tessera's names): no ranks needed."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from safetensors import SafetensorError
from tessera.training.run_config import said


def _export(args: argparse.Namespace) -> int:
    # lazy: tessera.parallel imports torch, which stays out of `tessera --help` and the torch-free commands
    from tessera.checkpointing.checkpoint import CheckpointError, export_checkpoint

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
        source = Path(args.checkpoint).resolve()
        if args.to_hf is not None and Path(target).resolve().is_relative_to(source):
            raise ValueError(
                f"--to-hf {target} is inside the checkpoint {args.checkpoint} it reads: its config.json and weights "
                f"would land among the checkpoint's files; name another directory"
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
    print(f"wrote {target}: model {manifest['model']['preset']} at {_step_of_run(manifest)}{written}")
    return 0


def _step_of_run(manifest: dict) -> str:
    """'step 5, the run's last', or 'step 4 of the run's 5 steps' (a checkpoint saved before the end)."""
    step = manifest["step"]
    steps = (manifest.get("config") or {}).get("runtime", {}).get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool):
        return f"step {step}"
    return f"step {step}, the run's last" if step >= steps else f"step {step} of the run's {steps} steps"


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
    from tessera.checkpointing.checkpoint import export_checkpoint, read_safetensors

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
    from tessera.checkpointing.safe_io import write_safetensors

    try:
        _check_out_path("--out", args.out)
        cfg = read_hf_config(args.from_hf, flag="from_hf")  # the family from config.json's model_type
        check_hf_weights(args.from_hf, cfg, flag="from_hf")
        # tessera's names; a tied parameter once, under its owner's name
        tensors = {
            ours: read_hf_parameter(source) for ours, source in hf_weight_map(args.from_hf, cfg, flag="from_hf").items()
        }
        tensors.update(_buffers_hf_lacks(cfg, tensors))
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


def _buffers_hf_lacks(cfg, tensors: dict) -> dict:
    """The model's persistent buffers a Hugging Face checkpoint of its family does not carry, at the values tessera
    initialises them to: an MoE block's routing bias (`expert_bias`, zeros) where the family has no counterpart
    (Qwen3-MoE, gpt-oss; DeepSeek-V3's is its e_score_correction_bias and comes from the file). Without them the
    file `--init-from` reads lacks names the model holds."""
    import torch  # lazy: as in _convert

    from tessera.models.spec import build_model  # lazy: as in _convert

    model = build_model(cfg, device="meta", seed=None)
    buffers = {name for name, _ in model.named_buffers()}
    out = {}
    for name, t in model.state_dict().items():
        if name not in tensors and name in buffers and name.endswith("expert_bias"):
            out[name] = torch.zeros(t.shape, dtype=t.dtype)
    return out


CONVERT_HELP = (
    "a Hugging Face directory (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3, gpt-oss: by config.json's model_type) to one "
    "safetensors file in tessera's names"
)


def add_export_parsers(sub: argparse._SubParsersAction) -> None:
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
        "architecture: LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM or "
        "GptOssForCausalLM; model.safetensors)",
    )
    exp.set_defaults(func=_export)

    conv = sub.add_parser(
        "convert",
        help=CONVERT_HELP,
        description=CONVERT_HELP,
    )
    conv.add_argument(
        "--from-hf", required=True, metavar="DIR", help="config.json + model.safetensors (or sharded with an index)"
    )
    conv.add_argument("--out", required=True, help="the .safetensors file to write")
    conv.set_defaults(func=_convert)

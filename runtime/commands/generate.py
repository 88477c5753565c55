"""`tessera generate --checkpoint DIR --prompt TEXT`: continue a prompt with a trained tessera checkpoint (or a
Hugging Face model folder, `--checkpoint hf:DIR`), greedy or top-p sampled, with a KV cache, on one process or
on `--tp N` tensor-parallel ranks (spawned as `tessera train` spawns them: gloo on CPU, NCCL on GPUs).

Every bad input is one line before any rank starts: a folder that is not a checkpoint, a prompt longer than
the model's context, a --tp that does not divide the heads, a --top-p outside (0, 1]. On the ranks the model
is built on the meta device, parallelized with tessera's own tensor-parallel layers (parallelize), and filled
from the checkpoint by DCP (each rank reads its own shards: any training layout loads on any tp) or from the
Hugging Face safetensors (each rank reads its own block); models/generation.py decodes. Nothing read from disk
runs code: DCP's metadata goes through parallel/safe_io's checked reader, Hugging Face weights are
safetensors only, and a tokenizer is a tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.training.run_config import said
from tessera.launching.rank_server import start_rank_server

HF_PREFIX = "hf:"
PROGRESS_EVERY = 16  # tokens per progress line (stderr)


@dataclass(frozen=True)
class Job:
    """What every rank needs, checked: where the weights are, the model's config, the prompt's ids."""

    checkpoint: str  # a tessera checkpoint directory (resolved), or a Hugging Face folder
    hf: bool
    config: Any  # the family's config
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[int, ...]
    tp: int
    dtype: str
    device: str
    progress: bool
    probe: bool  # measure the matmuls' dtype over the prefill (--json)


# ----------------------------------------------------------------------------- preflight (no ranks yet)
def _ids(text: str, flag: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(t) for t in text.replace(" ", "").split(",") if t != "")
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a comma-separated list of token ids; e.g. {flag} 1,2,3") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"{flag} {text!r} holds a negative token id; token ids are 0 .. vocab_size - 1")
    return ids


def _model_source(checkpoint: str) -> tuple[str, bool, Any, str | None]:
    """(the weights' path, whether it is a Hugging Face folder, the model's config, where its tokenizer may be);
    ValueError (a CheckpointError) naming the folder when it is neither a tessera checkpoint nor an HF model
    folder."""
    # lazy: tessera.models and tessera.parallel import torch, which stays out of `tessera --help`
    from tessera.models.hf import config_from_manifest, read_hf_config, weight_files
    from tessera.checkpointing.checkpoint import read_manifest, resolve

    if checkpoint.startswith(HF_PREFIX):
        folder = checkpoint[len(HF_PREFIX) :]
        cfg = read_hf_config(folder, flag="checkpoint=hf:")
        weight_files(folder, flag="checkpoint=hf:")  # safetensors only: a pickle is refused by name
        return folder, True, cfg, folder
    if not checkpoint:
        raise ValueError("checkpoint='' is an empty path; name a checkpoint directory (or hf:DIR)")
    path = resolve(checkpoint)
    manifest = read_manifest(path)
    return str(path), False, config_from_manifest(manifest["model"]), training_tokenizer(manifest)


def training_tokenizer(manifest: dict[str, Any]) -> str | None:
    """The tokenizer the checkpoint's run read its data with (`--tokenizer`), else the Hugging Face folder it
    started from (`--init-from-hf`, or a model named hf:DIR), as its manifest records them; None if neither."""
    config = manifest.get("config") or {}
    data, start = config.get("data") or {}, config.get("checkpoint") or {}
    preset = str((manifest.get("model") or {}).get("preset", ""))
    for hint in (data.get("tokenizer"), start.get("init_from_hf"), preset[3:] if preset.startswith("hf:") else None):
        if isinstance(hint, str) and hint:
            return hint
    return None


def _tokenizer(args: argparse.Namespace, hint: str | None) -> Any:
    """The `tokenizers` Tokenizer of --tokenizer (a tokenizer.json, or a folder holding one), else of `hint` (the
    hf:DIR folder, or the tokenizer the checkpoint's run used) when that still holds one; None when none is."""
    path = args.tokenizer
    if path is None and hint is not None:
        found = Path(hint) / "tokenizer.json" if Path(hint).is_dir() else Path(hint)
        path = hint if found.is_file() else None
    if path is None:
        return None
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        where = f"no tokenizer.json in {path}" if Path(path).is_dir() else f"{path} does not exist"
        raise ValueError(f"tokenizer={path}: {where}; name a tokenizer.json or a Hugging Face model folder")
    try:
        from tokenizers import Tokenizer  # lazy: tokenizers is optional (the data extra)
    except ImportError:
        raise ValueError(
            '`tokenizer` needs the tokenizers library: pip install -e ".[data]" in the tessera clone'
        ) from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the library raises its own Exception types for malformed files
        raise ValueError(f"tokenizer={path}: {file} is not a tokenizer.json ({str(e).splitlines()[0]})") from None


def _stop_ids(args: argparse.Namespace, folder: str | None) -> tuple[int, ...]:
    """--stop-ids, else what transformers stops at: the HF folder's generation_config.json (or config.json)
    eos_token_id; none for a tessera checkpoint."""
    if args.stop_ids is not None:
        return _ids(args.stop_ids, "--stop-ids")
    for name in ("generation_config.json", "config.json"):
        file = Path(folder) / name if folder is not None else None
        if file is None or not file.is_file():
            continue
        try:
            eos = json.loads(file.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            continue  # config.json was read (and checked) already; a damaged generation config: no stop ids
        if eos is not None:
            return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    return ()


def _prompt_ids(args: argparse.Namespace, tokenizer: Any, vocab_size: int) -> tuple[int, ...]:
    # lazy: tessera.models imports torch
    from tessera.data.corpus import BOS, BYTE_VOCAB

    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("give one of --prompt TEXT or --prompt-ids 1,2,3")
    if args.prompt_ids is not None:
        ids = _ids(args.prompt_ids, "--prompt-ids")
    elif tokenizer is not None:
        ids = tuple(tokenizer.encode(args.prompt, add_special_tokens=True).ids)
    elif vocab_size == BYTE_VOCAB:  # the debug presets' byte vocabulary needs no tokenizer
        ids = (BOS, *args.prompt.encode("utf-8"))
    else:
        raise ValueError(
            f"`prompt` needs a tokenizer for this model's vocabulary of {vocab_size}: give --tokenizer "
            f"tokenizer.json (or a Hugging Face model folder), or the ids with --prompt-ids 1,2,3"
        )
    if not ids:
        raise ValueError("the prompt is empty (no tokens); give some text or ids")
    too_big = [i for i in ids if i >= vocab_size]
    if too_big:
        raise ValueError(
            f"the prompt holds token id {too_big[0]}, outside the model's vocabulary of {vocab_size} "
            f"(a tokenizer of another model?)"
        )
    return ids


def preflight(args: argparse.Namespace) -> tuple[Job, Any]:
    """The checked Job and the tokenizer (None: ids only); ValueError naming the flag for any bad input."""
    # lazy: these import torch
    from tessera.models.generation import Sampling
    from tessera.models.spec import spec_of
    from tessera.topology.shapes import check_tensor_parallel

    if args.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={args.max_new_tokens} must be at least 1")
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"seed={args.seed} is outside 0 .. 2**63 - 1 (a generator's seed)")
    if args.tp < 1:
        raise ValueError(f"tp={args.tp} must be at least 1")
    Sampling(args.temperature, args.top_p, args.seed)  # --top-p outside (0, 1], a negative temperature
    path, hf, cfg, hint = _model_source(args.checkpoint)
    check_tensor_parallel(spec_of(cfg).shape(cfg), args.tp)
    folder = path if hf else None
    tokenizer = _tokenizer(args, hint)
    prompt = _prompt_ids(args, tokenizer, cfg.vocab_size)
    context = cfg.max_seq_len
    if len(prompt) >= context:
        raise ValueError(
            f"the prompt is {len(prompt)} tokens, longer than the model's context of {context} tokens "
            f"(max_seq_len) with room for one more; shorten it to at most {context - 1} tokens"
        )
    if len(prompt) + args.max_new_tokens > context:
        raise ValueError(
            f"max_new_tokens={args.max_new_tokens} after a prompt of {len(prompt)} tokens passes the model's "
            f"context of {context} tokens; use max_new_tokens={context - len(prompt)} or fewer"
        )
    stop = _stop_ids(args, folder)
    beyond = [i for i in stop if i >= cfg.vocab_size]
    if beyond and args.stop_ids is not None:  # an id the model can never emit would never stop it
        raise ValueError(
            f"stop_ids={beyond[0]} is outside the model's vocabulary of {cfg.vocab_size} (ids 0 .. "
            f"{cfg.vocab_size - 1}): the model never emits it, so it would never stop; give ids it can emit"
        )
    job = Job(
        path,
        hf,
        cfg,
        prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_p,
        args.seed,
        stop,
        args.tp,
        args.dtype,
        _device(args.device, args.tp),
        not args.quiet,
        args.json,
    )
    return job, tokenizer


def _device(device: str, tp: int) -> str:
    import torch  # lazy: torch stays out of `tessera --help`

    if device == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= tp else "cpu"
    if device == "cuda" and torch.cuda.device_count() < tp:
        raise ValueError(
            f"device=cuda with tp={tp} needs {tp} GPU{'s' * (tp > 1)}; this machine has {torch.cuda.device_count()}"
        )
    return device


# ----------------------------------------------------------------------------- on each rank
def load_model(job: Job, meshes: Any = None) -> Any:
    """The job's model on this rank: built on meta, tensor parallel over `meshes.tp` (None: one process), its
    weights from the checkpoint, in eval mode and the job's dtype."""
    import torch  # lazy: torch stays out of `tessera --help`
    import torch.distributed.checkpoint as dcp  # lazy: as torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict  # lazy: as torch

    from tessera.models.hf import load_hf_weights  # lazy: as torch
    from tessera.models.spec import spec_of  # lazy: as torch
    from tessera.parallel import ParallelConfig, materialize, parallelize  # lazy: as torch
    from tessera.checkpointing.checkpoint import SHARDED_KEY, SafeFileSystemReader, SafeLoadPlanner  # lazy: as torch
    from tessera.checkpointing.checkpoint import read_manifest, verify_files  # lazy: as torch
    from tessera.topology import Layout  # lazy: as torch

    spec = spec_of(job.config)
    device = torch.device(job.device, torch.cuda.current_device()) if job.device == "cuda" else torch.device("cpu")
    model = spec.build_model(job.config, device="meta")
    if meshes is not None:  # the logits stay split over the vocabulary: `_gather_vocab` joins them
        parallelize(model, meshes, ParallelConfig(Layout(tp=job.tp), loss="logits"), spec=spec)
    materialize(model, device, seed=0, spec=spec)  # allocated and the RoPE tables computed; weights next
    if job.hf:
        load_hf_weights(model, job.checkpoint)
    else:
        path = Path(job.checkpoint)
        verify_files(path, read_manifest(path))  # every file's size and sha256 before DCP reads it
        reader = SafeFileSystemReader(str(path / "state"))
        reader.read_metadata()  # a crafted metadata pickle fails here, with its own message
        state = get_model_state_dict(model)
        # the model's half of what training saved (runtime/checkpointing/checkpoint.py's ModelOptimizerState), resharded
        with warnings.catch_warnings():  # one process: DCP says it loads without a process group, as meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({SHARDED_KEY: {"model": state}}, storage_reader=reader, planner=SafeLoadPlanner())
        set_model_state_dict(model, state)
    return _cast_parameters(model, getattr(torch, job.dtype)).eval()


def _cast_parameters(model: Any, dtype: Any) -> Any:
    """The parameters in `dtype`; the buffers (RoPE's tables, an MoE's routing bias) keep their dtype, as
    training's mixed precision keeps them (it casts parameters only)."""
    kept = {name: b.dtype for name, b in model.named_buffers()}
    model.to(dtype)
    for name, buffer_dtype in kept.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        setattr(module, attr, getattr(module, attr).to(buffer_dtype))
    return model


def _gather_vocab(group: Any, vocab_size: int) -> Any:
    """A tensor-parallel head's logits (B, S, V / tp, the vocabulary split as torch.chunk splits it) ->
    (B, S, V) on every rank."""
    import torch  # lazy: torch stays out of `tessera --help`
    import torch.distributed as dist  # lazy: as torch

    size = dist.get_world_size(group)
    chunk = -(-vocab_size // size)

    def gather(local: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(local, (0, chunk - local.shape[-1])).contiguous()
        pieces = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(pieces, padded, group=group)
        return torch.cat([p[..., : min(chunk, max(0, vocab_size - r * chunk))] for r, p in enumerate(pieces)], -1)

    return gather


def run(job: Job, meshes: Any = None, rank: int = 0) -> dict[str, Any]:
    """Generate on this rank (one process: `meshes` None); the result every rank computes alike."""
    import torch  # lazy: torch stays out of `tessera --help`

    from tessera.metrics.dtype_probe import MatmulDtypes  # lazy: as torch
    from tessera.models.generation import Sampling, generate  # lazy: as torch

    model = load_model(job, meshes)
    full = None if meshes is None else _gather_vocab(meshes.tp.get_group(), job.config.vocab_size)
    device = next(model.parameters()).device
    prompt = torch.tensor([job.prompt], dtype=torch.long, device=device)
    n = job.max_new_tokens

    def progress(done: int, seconds: float) -> None:
        if job.progress and rank == 0 and (done % PROGRESS_EVERY == 0 or done == n):
            print(f"generate: {done}/{n} tokens, {seconds:.2f} s ({done / seconds:.1f} tokens/s)", file=sys.stderr)

    probe = MatmulDtypes() if job.probe else None
    out = generate(
        model,
        prompt,
        n,
        Sampling(job.temperature, job.top_p, job.seed),
        stop=job.stop,
        full_logits=full,
        on_token=progress,
        prefill_context=probe,
    )
    tokens = out.tokens[0]
    if job.progress and rank == 0 and len(tokens) < n:  # a stop token ended it before its last progress line
        print(f"generate: stopped at token {len(tokens)} of {n} (stop id {tokens[-1]})", file=sys.stderr)
    decoded = len(tokens) - 1  # tokens after the first, which the prefill gives
    return {
        "tokens": tokens,
        "prompt_tokens": len(job.prompt),
        "new_tokens": len(tokens),
        "stopped": bool(tokens) and tokens[-1] in job.stop,
        "prefill_s": out.prefill_s,
        "decode_s": out.decode_s,
        "decode_tokens_per_s": decoded / out.decode_s if decoded and out.decode_s > 0 else None,
        "tokens_per_s": len(tokens) / (out.prefill_s + out.decode_s),
        "compute_dtype": probe.report()["compute_dtype"] if probe is not None else None,
    }


def _rank_main(job: Job) -> dict[str, Any] | None:
    """One tensor-parallel rank (run_ranks has started the process group); rank 0 returns the result."""
    import torch  # lazy: torch stays out of `tessera --help`
    import torch.distributed as dist  # lazy: as torch

    from tessera.topology import Layout, Meshes  # lazy: as torch

    rank = dist.get_rank()
    if job.device == "cuda":
        torch.cuda.set_device(rank)
    meshes = Meshes(Layout(tp=job.tp), job.device)
    result = run(job, meshes, rank)
    return result if rank == 0 else None


def generate_job(job: Job) -> dict[str, Any]:
    """Run the job: in this process (tp 1), or on tp spawned ranks."""
    if job.tp == 1:
        return run(job)
    from tessera.launching.launch import run_ranks  # lazy: it imports torch

    backend = "nccl" if job.device == "cuda" else "gloo"
    result = run_ranks(_rank_main, job.tp, job, timeout=None, collective_timeout=600.0, backend=backend)[0]
    if result is None:  # rank 0 always returns one
        raise RuntimeError("rank 0 returned no result")
    return dict(result)


# ----------------------------------------------------------------------------- the command
def _text(tokenizer: Any, ids: list[int], vocab_size: int) -> str | None:
    from tessera.data.corpus import BYTE_VOCAB, decode  # lazy: tessera.models imports torch

    if tokenizer is not None:
        return str(tokenizer.decode(ids, skip_special_tokens=True))
    return decode(ids) if vocab_size == BYTE_VOCAB else None


def _generate(args: argparse.Namespace) -> int:
    if args.tp > 1:  # the ranks' forkserver imports torch beside this process's own imports, as train's does
        start_rank_server()
    # lazy: these import torch
    from tessera.launching.launch import RankFailure

    try:
        job, tokenizer = preflight(args)
    except ValueError as e:  # CheckpointError and ConfigError included
        print(f"tessera generate: error: {said(e, args)}", file=sys.stderr)
        return 2
    try:
        result = generate_job(job)
    except RankFailure as e:  # a rank's named failure is the command's one line
        if e.cause is not None and e.cause["tessera"]:
            print(f"tessera generate: error: {said(ValueError(e.cause['message']), args)}", file=sys.stderr)
            return int(e.cause["exit_code"])
        raise
    except ValueError as e:  # a damaged checkpoint file found while loading (CheckpointError), on one process
        print(f"tessera generate: error: {said(e, args)}", file=sys.stderr)
        return 2
    text = _text(tokenizer, result["tokens"], job.config.vocab_size)
    if args.json:
        record = {
            **result,
            "text": text,
            "prompt_ids": list(job.prompt),
            "checkpoint": args.checkpoint,
            "family": job.config.family,
            "tp": job.tp,
            "device": job.device,
            "weights_dtype": job.dtype,
            "sampling": {"temperature": job.temperature, "top_p": job.top_p, "seed": job.seed},
        }
        print(json.dumps(record, allow_nan=False))
    else:
        print(text if text is not None else " ".join(map(str, result["tokens"])))
    return 0


def _finite(value: str) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{value} is not a finite number")
    return number


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate",
        help="continue a prompt with a checkpoint or a Hugging Face model: greedy or top-p, KV cache, --tp ranks",
        description="Continue a prompt with a tessera checkpoint (or hf:DIR, a Hugging Face model folder): greedy "
        "(the default) or top-p sampling, with a KV cache, on one process or on --tp tensor-parallel ranks. The "
        "continuation is printed (--json: the ids, tokens/s and the matmuls' dtype as measured); a progress line "
        f"every {PROGRESS_EVERY} tokens goes to stderr.",
    )
    gen.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a checkpoint directory (or a --checkpoint-dir with a latest pointer), or hf:DIR for a Hugging Face "
        "model folder (config.json, safetensors)",
    )
    gen.add_argument("--prompt", default=None, metavar="TEXT", help="the text to continue (tokenized with --tokenizer)")
    gen.add_argument(
        "--prompt-ids", default=None, metavar="IDS", help="the prompt as token ids, e.g. 1,2,3 (no tokenizer needed)"
    )
    gen.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a tokenizer.json or a Hugging Face model folder holding one (default: hf:DIR's own, or the one "
        "the checkpoint's run used: its --tokenizer or --init-from-hf folder; the debug presets' byte vocabulary "
        "needs none)",
    )
    gen.add_argument(
        "--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate at most (default: 32)"
    )
    gen.add_argument(
        "--temperature",
        type=_finite,
        default=0.0,
        metavar="T",
        help="0: greedy (default); above 0: sample at this temperature",
    )
    gen.add_argument(
        "--top-p",
        type=_finite,
        default=1.0,
        metavar="P",
        help="sample from the most likely tokens of this mass, in (0, 1]",
    )
    gen.add_argument("--seed", type=int, default=0, metavar="N", help="the sampling generator's seed (default: 0)")
    gen.add_argument(
        "--stop-ids",
        default=None,
        metavar="IDS",
        help="token ids that end the text, e.g. 257 (default: hf:DIR's eos_token_id, as transformers stops)",
    )
    gen.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel ranks to generate on (default: 1)")
    gen.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="the weights' dtype (default: float32)"
    )
    gen.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA with tp GPUs")
    gen.add_argument("--json", action="store_true", help="one JSON object: ids, text, tokens/s, compute dtype")
    gen.add_argument("--quiet", action="store_true", help="no progress lines")
    gen.set_defaults(func=_generate)

"""Distributed checkpoints (DCP) with a resume manifest, and full state dicts for inference.

A checkpoint directory:

    root/
      latest                  the name of the newest complete checkpoint (updated last, atomically)
      step_00000003/
        manifest.json         everything a faithful resume needs besides the tensors (below)
        state/                DCP: model and optimizer, sharded; each rank writes its own shards
        rng/rank{r}.pt        each rank's RNG states

Saves are atomic: everything is written under `.step_N.tmp`, checksummed, and renamed; `latest` moves
last; only the newest `keep` are kept. Nothing is gathered onto rank 0. Loading reshards: DCP cuts every
tensor for the loading layout, and the data cursor counts global sequences, so a run saved on one layout
resumes on another. Every file is size- and sha256-checked before DCP reads it, so a truncated or
corrupt shard fails naming the file instead of loading partially.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from tessera.models.init import one_process_name
from tessera.models.spec import build_model
from tessera.topology.errors import TesseraWarning

from .locks import directory_lock, pinned_steps  # noqa: F401 (directory_lock: part of this module's API)
from .safe_io import (  # re-exported: CheckpointError and the safetensors functions are part of this module's API
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    _SafeEmptyLoadPlanner,
    read_safetensors,
    read_safetensors_header,
    write_safetensors,
)

FORMAT_VERSION = 3  # 3: optimizer state flattened by parameter name (any pp split loads any other)
MANIFEST = "manifest.json"
SHARDED_KEY = "model_optimizer"  # the DCP key of the model and optimizer state


# ----------------------------------------------------------------------------- paths
def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory: `path` itself (used as given: an explicit checkpoint that is bad stops the
    run), or the one a checkpoint root's `latest` pointer names. When that one is incomplete or damaged
    (a missing or edited manifest, a missing or truncated file), the newest intact checkpoint of the root
    is used instead, with a warning naming the problem."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    latest = path / "latest"
    if latest.exists():
        target = path / latest.read_text().strip()
        problem = structural_problem(target)
        if problem is None:
            return target
        for older in sorted(path.glob("step_*"), reverse=True):
            if older != target and structural_problem(older) is None:
                why = f"the latest checkpoint {target} is unusable ({problem}); using {older}, the newest intact one"
                warnings.warn(why, TesseraWarning, stacklevel=2)
                return older
        raise CheckpointError(
            f"{latest} points to {target}, which is unusable ({problem}), and no older checkpoint in {path} is intact"
        )
    if path.is_dir():
        raise CheckpointError(
            f"no {MANIFEST} (and no 'latest' pointer) in {path}: not a tessera checkpoint, or an interrupted save"
        )
    found = f"is a file; a tessera checkpoint is a directory holding {MANIFEST}" if path.exists() else ""
    raise CheckpointError(f"checkpoint {path} {found or 'does not exist'}")


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's content (everything but the digest itself), as saved."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"missing manifest {file}: the checkpoint is incomplete") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupt manifest {file}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{file} has format {found!r}; this tessera reads format {FORMAT_VERSION}")
    if manifest.get("digest") != manifest_digest(manifest):
        raise CheckpointError(
            f"{file} was edited after the save (its digest does not match its content); resume from another checkpoint"
        )
    return manifest


def structural_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot load, found without hashing (manifest, file presence and
    sizes), or None. Checksums are verified when it loads."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return str(e)
    for name, want in manifest.get("files", {}).items():
        file = path / name
        if not file.exists():
            return f"missing checkpoint file {file}"
        if file.stat().st_size != want["bytes"]:
            return (
                f"truncated or altered checkpoint file {file}: {file.stat().st_size} bytes, "
                f"the manifest says {want['bytes']}"
            )
    return None


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _my_share(files: list[Path], rank: int, world: int) -> list[Path]:
    return [f for i, f in enumerate(files) if i % world == rank]


# ----------------------------------------------------------------------------- the manager
class ModelOptimizerState:
    """The model part(s) and their optimizers as one DCP Stateful: sharded tensors, resharded on load.

    Each part has its own optimizer (`optimizers.optimizers`, or one plain optimizer for one part), and
    both model and optimizer state are keyed by the one-process parameter names (the optimizer state
    flattened: state.<parameter name>.exp_avg), so a checkpoint saved on any layout, any
    pp split included, loads on any other."""

    def __init__(self, parts: list[torch.nn.Module], optimizers: Any):
        self.parts = parts
        # one optimizer per part, or a list per part (Muon beside AdamW: DCP takes several)
        self.optimizers = (
            optimizers if isinstance(optimizers, list) else list(getattr(optimizers, "optimizers", [optimizers]))
        )
        if len(self.optimizers) != len(parts):
            raise ValueError(f"{len(parts)} model parts need one optimizer each, got {len(self.optimizers)}")

    def state_dict(self) -> dict[str, Any]:
        model, optim = {}, {}
        for part, optimizer in zip(self.parts, self.optimizers):
            m, o = get_state_dict(part, optimizer, options=_OPTIONS)
            model.update(m)
            optim.update(o)
        return {"model": _ordinary_tensors(model), "optimizer": _ordinary_tensors(optim)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, optimizer in zip(self.parts, self.optimizers):
            names = set(get_model_state_dict_names(part))
            model = {k: v for k, v in state["model"].items() if k in names}
            optim = {k: v for k, v in state["optimizer"].items() if _optim_key_param(k) in names}
            set_state_dict(part, optimizer, model_state_dict=model, optim_state_dict=optim, options=_OPTIONS)


_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _ordinary_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with torchao's FSDP2 float8 weight wrapper (--fp8 tensorwise under FSDP2: each shard's fp32 tensor
    wrapped so that FSDP2 all-gathers it in FP8, the optimizer's moments too) replaced by the fp32 shard it wraps,
    sharing its storage: checkpoints hold ordinary tensors, readable without torchao (an export, a resume
    without --fp8) by the weights-only loader, and a load writes into the parameters' own storage."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")  # never imported here: no FP8 run, no wrapper
    wrapper = getattr(fsdp_utils, "WeightWithDynamicFloat8CastTensor", None)
    if wrapper is None:
        return state
    out = {}
    for key, value in state.items():
        local = value._local_tensor if isinstance(value, DTensor) else None
        if isinstance(local, wrapper):
            value = DTensor.from_local(
                local._tensor,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        out[key] = value
    return out


def get_model_state_dict_names(part: torch.nn.Module) -> list[str]:
    """The state-dict names of a part (one-process names: wrappers' prefixes removed)."""
    return [one_process_name(k) for k in part.state_dict().keys()]


def _optim_key_param(key: str) -> str:
    """state.<parameter name>.exp_avg -> <parameter name> (the same for param_groups)."""
    return key.split(".", 1)[1].rsplit(".", 1)[0]


@dataclass
class _PendingSave:
    step: int
    tmp: Path
    final: Path
    small: dict[str, Any]  # the small pieces' state dicts, captured when the save began
    info: dict[str, Any]
    upload: Any  # DCP's future of the files (None: written already)


class CheckpointManager:
    """Saves and loads checkpoints of Stateful pieces; it knows nothing of the trainer.

    `sharded` pieces (model, optimizer) go through DCP, each rank writing its own shards; `small`
    pieces (scheduler, data cursor, progress) have JSON state dicts and are stored in the manifest,
    beside the `info` the caller describes the run with (step, layout, model, config, ...)."""

    def __init__(self, root: str | os.PathLike | None, keep: int = 3, own_pin: str | None = None):
        self.root = Path(root) if root is not None else None
        self.keep = keep
        self.own_pin = own_pin  # the pin of the step this run resumed from: rotated like any other once older
        self.pending: _PendingSave | None = None  # an async save whose files are still being written
        self.async_group: dist.ProcessGroup | None = None
        self.blocked_s = 0.0  # how long the last save() held its caller (an async one: the staging only)

    def save(
        self,
        step: int,
        sharded: dict[str, Any],
        small: dict[str, Any],
        info: dict[str, Any],
        asynchronous: bool = False,
    ) -> Path:
        """Write the checkpoint of `step`; collective over all ranks. Returns its path.

        `asynchronous`: DCP's async save. The caller is blocked only while the sharded state is staged (copied
        to host memory) and the small pieces' state captured; the files are written by a background thread
        (its collectives on a process group of their own), and the checkpoint becomes `latest` only when every
        rank has written its files: at a later `poll()` that finds them all done, or at `finish()`. Until then
        `latest` names the previous complete checkpoint, so a run killed mid-save resumes from that one."""
        if self.root is None:
            raise CheckpointError("no checkpoint directory: give CheckpointManager a root to save into")
        self.finish()  # one save in flight at a time
        root = self.root
        rank = dist.get_rank()
        final, tmp = step_dir(root, step), root / f".step_{step:08d}.tmp"
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save interrupted earlier
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        # the small pieces and the RNG as they are now: training moves them on while an async save writes
        captured = {name: json.loads(json.dumps(piece.state_dict())) for name, piece in small.items()}
        torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
        started = time.perf_counter()
        if asynchronous:
            response = dcp.async_save(
                dict(sharded), checkpoint_id=str(tmp / "state"), process_group=self._async_group()
            )
            upload = getattr(response, "upload_completion", response)  # a Future, or AsyncSaveResponse's
            self.blocked_s = time.perf_counter() - started
            self.pending = _PendingSave(step, tmp, final, captured, dict(info), upload)
            return final
        dcp.save(dict(sharded), checkpoint_id=str(tmp / "state"))
        self.blocked_s = time.perf_counter() - started
        self._finalize(_PendingSave(step, tmp, final, captured, dict(info), None))
        return final

    def _async_group(self) -> dist.ProcessGroup:
        """A gloo group of every rank for the background writes: their collectives must not interleave with
        training's on the default group (gloo also runs on GPU hosts: the staged state is in host memory)."""
        if self.async_group is None:
            self.async_group = dist.new_group(backend="gloo")
        return self.async_group

    def poll(self) -> Path | None:
        """Complete a pending async save if every rank has written its files (one small all-reduce while one
        is pending; collective). Returns the checkpoint made `latest`, if any."""
        if self.pending is None:
            return None
        done = torch.tensor([1 if self.pending.upload.done() else 0], dtype=torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return self.finish() if done.item() else None

    def finish(self) -> Path | None:
        """Wait for a pending async save's files (every rank) and make it `latest`; collective."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        pending.upload.result()  # a failed write raises here
        self._finalize(pending)
        return pending.final

    def _finalize(self, p: "_PendingSave") -> None:
        """Checksums, the manifest, then the atomic rename and the `latest` pointer (rank 0); collective."""
        root, rank, world = self.root, dist.get_rank(), dist.get_world_size()
        if root is None:  # save() refuses to start without one
            raise CheckpointError("no checkpoint directory: give CheckpointManager a root to save into")
        dist.barrier()
        # every rank checksums a share of the files; rank 0 collects them into the manifest
        files = sorted(f for f in p.tmp.rglob("*") if f.is_file())
        mine = {
            str(f.relative_to(p.tmp)): {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            for f in _my_share(files, rank, world)
        }
        shares: list[Any] = [None] * world
        dist.all_gather_object(shares, mine)
        if rank == 0:
            manifest = {
                **p.info,
                **p.small,
                "format": FORMAT_VERSION,
                "step": p.step,
                "rng": {"dir": "rng", "world_size": world},
                "world_size": world,
                "versions": _versions(),
                "created_unix": time.time(),
                "files": {k: v for share in shares for k, v in share.items()},
            }
            manifest["digest"] = manifest_digest(manifest)  # an edited manifest is refused on load
            (p.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            shutil.rmtree(p.final, ignore_errors=True)
            os.rename(p.tmp, p.final)
            pointer = root / "latest.tmp"
            pointer.write_text(p.final.name)
            os.replace(pointer, root / "latest")
            pinned = pinned_steps(root, self.own_pin)  # steps a live reader resumes from stay until it ends
            for old in sorted(root.glob("step_*"))[: -self.keep] if self.keep > 0 else []:
                if old.name not in pinned:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def load(
        self,
        path: str | os.PathLike,
        sharded: dict[str, Any],
        small: dict[str, Any],
        check: Callable[[Path, dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Run `check(path, manifest)` (e.g. `check_compatible`), verify every file, then restore the
        pieces (any layout) and this rank's RNG; collective. Returns the manifest."""
        path = resolve(path)
        manifest = read_manifest(path)
        if check is not None:
            check(path, manifest)
        verify_files(path, manifest)
        reader = SafeFileSystemReader(str(path / "state"))
        reader.read_metadata()  # a crafted metadata pickle fails here, with its own message, not inside DCP
        dcp.load(dict(sharded), storage_reader=reader, planner=SafeLoadPlanner())
        for name, piece in small.items():
            piece.load_state_dict(manifest[name])
        rank = dist.get_rank()
        # same world size: each rank gets its own generator back; otherwise rank 0's (training draws none today)
        rng_file = path / "rng" / f"rank{rank if manifest['world_size'] == dist.get_world_size() else 0}.pt"
        rng = torch.load(rng_file, weights_only=True)  # tensors and ints only: nothing on disk runs code
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        random.setstate(_as_tuple(rng["python"]))
        return manifest


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _versions() -> dict[str, str]:
    try:
        tessera_version = version("tessera-4d")
    except PackageNotFoundError:
        tessera_version = "unknown"
    return {"tessera": tessera_version, "torch": torch.__version__}


# ----------------------------------------------------------------------------- load
def verify_files(path: Path, manifest: dict[str, Any]) -> None:
    """Size- and checksum-check every file the manifest lists (the work split over the ranks); raise
    CheckpointError naming the first bad file on every rank."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    listed = sorted(manifest.get("files", {}))
    if not listed:
        raise CheckpointError(f"{path / MANIFEST} lists no files; the checkpoint is incomplete")
    problem = ""
    for name in listed:  # sizes everywhere (cheap), hashes of this rank's share
        file, want = path / name, manifest["files"][name]
        if not file.exists():
            problem = f"missing checkpoint file {file}"
        elif file.stat().st_size != want["bytes"]:
            problem = (
                f"truncated or altered checkpoint file {file}: {file.stat().st_size} bytes, "
                f"the manifest says {want['bytes']}"
            )
        if problem:
            break
    if not problem:
        for name in _my_share(listed, rank, world):
            if _sha256(path / name) != manifest["files"][name]["sha256"]:
                problem = f"corrupt checkpoint file {path / name}: sha256 differs from the manifest"
                break
    problems: list[Any] = [problem]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), "")
    if first:
        raise CheckpointError(first)


def check_optimizer(path: Path, manifest: dict[str, Any], optimizer: str) -> None:
    """Raise CheckpointError unless the checkpoint was trained with `optimizer` (adamw or muon): the other's
    state (two AdamW moments, or one Muon momentum) is not there to resume from."""
    saved = manifest.get("config", {}).get("optimizer", {}).get("optimizer", "adamw")
    if saved != optimizer:
        raise CheckpointError(
            f"checkpoint {path} was trained with optimizer={saved}, this run asks for optimizer={optimizer}: its "
            f"optimizer state does not carry over; resume with optimizer={saved} (or start a new run from its "
            "weights with init_from=FILE after `tessera export`)"
        )


def _same_setting(saved: Any, now: Any) -> bool:
    """JSON holds inf as a string and floats as written: 'inf' and inf, 1 and 1.0, are the same setting."""
    if saved == now:
        return True
    try:
        return float(saved) == float(now)
    except (TypeError, ValueError):
        return False


def check_compatible(
    path: Path,
    manifest: dict[str, Any],
    model: str,
    model_config: dict[str, Any],
    seq_len: int,
    global_batch: int | None = None,
    steps: int | None = None,
    optimizer: dict[str, Any] | None = None,
) -> None:
    """Raise CheckpointError unless the checkpoint holds this model, was trained at this seq_len and
    global batch (the data cursor counts sequences of the saved run), for this many steps and with these
    `optimizer` settings (the LR schedule and the optimizer of the saved run: --lr and --warmup once changed the
    resumed steps silently while --steps was refused), and still has steps left to train."""
    saved = manifest["model"]
    # as the manifest holds it: JSON has no tuples (gpt-oss's layer_types and rope_scaling came back as lists)
    model_config = json.loads(json.dumps(model_config))
    if saved["config"] != model_config:
        diff = {k: (saved["config"].get(k), v) for k, v in model_config.items() if saved["config"].get(k) != v}
        if saved["preset"] != model:
            raise CheckpointError(
                f"checkpoint {path} holds model {saved['preset']!r}, not {model!r}; resume with "
                f"preset={saved['preset']} (differences, saved vs now: {diff})"
            )
        # the same preset with a field changed (--vocab-size, --n-layers): name the field, not the preset twice
        fields = ", ".join(f"{k}={was!r} where this run has {now!r}" for k, (was, now) in diff.items())
        first, (was, _) = next(iter(diff.items()))
        raise CheckpointError(
            f"checkpoint {path} holds {saved['preset']!r} with {fields}; resume with the model it saved ({first}={was})"
        )
    data = manifest["data"]
    if data["seq_len"] != seq_len:
        raise CheckpointError(
            f"checkpoint {path} was trained with seq_len={data['seq_len']}, this run uses {seq_len}; "
            f"use seq_len={data['seq_len']} to resume faithfully"
        )
    if global_batch is not None and data["global_batch"] != global_batch:
        raise CheckpointError(
            f"checkpoint {path} was trained with global_batch={data['global_batch']}, this run uses {global_batch}: "
            f"the data cursor and the loss scale would change mid-run; use global_batch={data['global_batch']}"
        )
    saved_steps = manifest.get("steps")
    if steps is not None and saved_steps is not None and saved_steps != steps:
        raise CheckpointError(
            f"checkpoint {path} is from a run of steps={saved_steps}, this run asks for {steps}: the cosine "
            f"learning-rate schedule would jump mid-run; use steps={saved_steps} to continue it faithfully"
        )
    saved_optimizer = (manifest.get("config") or {}).get("optimizer")
    # (an older checkpoint holds no config; another optimizer altogether is check_optimizer's to refuse)
    same_kind = isinstance(saved_optimizer, dict) and saved_optimizer.get("optimizer", "adamw") == (
        optimizer or {}
    ).get("optimizer", "adamw")
    if optimizer is not None and isinstance(saved_optimizer, dict) and same_kind:
        held = {k: v for k, v in optimizer.items() if k != "optimizer"}
        changed = [k for k, v in held.items() if k in saved_optimizer and not _same_setting(saved_optimizer[k], v)]
        if changed:
            k = changed[0]
            was = saved_optimizer[k]
            raise CheckpointError(
                f"checkpoint {path} was trained with {k}={was!r}, this run asks for {optimizer[k]!r}: a resume "
                f"continues the run's optimizer and schedule as saved; resume with {k}={was!r}, or start a new run "
                f"from an exported checkpoint (init_from=FILE)"
            )
    if steps is not None and manifest["step"] >= steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {manifest['step']}, already at steps={steps}: nothing left to train; "
            f"start a new run from an exported checkpoint (init_from=FILE) to train further"
        )


# ----------------------------------------------------------------------------- full state dicts
def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike) -> dict[str, Any]:
    """One process, no ranks: turn a checkpoint's sharded model into one full safetensors file."""
    path = resolve(path)
    manifest = read_manifest(path)
    verify_files(path, manifest)
    reader = SafeFileSystemReader(str(path / "state"))
    reader.read_metadata()  # a crafted metadata pickle fails here, with its own message
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader, planner=_SafeEmptyLoadPlanner(), no_dist=True)
    model = state[SHARDED_KEY]["model"]
    write_safetensors(model, out, {"preset": manifest["model"]["preset"], "step": str(manifest["step"])})
    return manifest


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """name -> its owner's name, for each parameter that is another's (a tied head is the embedding): the files
    tessera writes hold a tied parameter once, under the owner's name."""
    owners: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.update({name: owners[id(p)]} if id(p) in owners else {})
        owners.setdefault(id(p), name)
    return out


def load_full_state_dict(model: torch.nn.Module, file: str | os.PathLike) -> None:
    """Load a full (unsharded) state dict into a model on any layout: rank 0 reads, DCP scatters."""
    full: dict[str, Any] = read_safetensors(file) if dist.get_rank() == 0 else {}
    config = getattr(model, "config", None)
    if full and config is not None:  # a pipeline's last stage holds a tied head apart from the embedding: its
        # name is the whole model's alias of the embedding, which the file holds once
        for alias, owner in tied_aliases(build_model(config, device="meta", seed=None)).items():
            if alias not in full and owner in full:
                full[alias] = full[owner]
    # not strict: a pipeline stage takes only the names it holds; each must be in the file
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    missing = set_model_state_dict(model, full, options=options).missing_keys
    aliases = tied_aliases(model)  # a tied parameter loads under its owner's name
    missing = [k for k in missing if k not in aliases or aliases[k] in missing]
    if missing:
        raise CheckpointError(f"{file} lacks {len(missing)} parameter(s) of this model, e.g. {sorted(missing)[0]}")


def check_full_state_dict_file(file: str | os.PathLike, model_config: Any) -> None:
    """Raise CheckpointError unless `file` holds exactly the parameters of `model_config`, shape for shape."""
    header = read_safetensors_header(file)
    model = build_model(model_config, device="meta")
    aliases = tied_aliases(model)
    have = {k: v.get("shape") for k, v in header.items()}
    # a tied parameter is held once, under its owner's name (or under both, as a full state dict has it)
    want = {k: list(v.shape) for k, v in model.state_dict().items() if k not in aliases or aliases[k] not in have}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    wrong = [k for k in want if k in have and have[k] != want[k]]
    if missing or extra or wrong:
        detail = (
            (f"missing {missing[:3]}" if missing else "")
            or (f"unexpected {extra[:3]}" if extra else "")
            or (f"{wrong[0]} has shape {have[wrong[0]]}, the model needs {want[wrong[0]]}")
        )
        raise CheckpointError(
            f"init_from={file} does not hold this model's weights ({detail}); pass the `preset` (and `n_layers`) "
            f"it was exported from"
        )

"""--tensorboard DIR and --wandb PROJECT: rank 0's step records, beside the JSONL metrics file, as scalars.

Each step record becomes scalars by one rule (`scalars`): every number in it under its key, nested keys
joined by "/" (`comm/bytes_by_axis/tp`), booleans as 0/1; the layout, dtype names, checksums and the profile
stay in the JSONL only, and a non-finite value (null in the JSONL) is left out. Both writers flush every step,
and a resumed run continues the same curves: TensorBoard in the same DIR from the resumed step (later events
of an earlier attempt are purged), W&B under the run id kept beside the checkpoint (`wandb_run_id`).

Nothing here imports torch or the optional libraries at module level: the pre-run checks import it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any

from tessera.paths import check_writable_dir

# record keys that are no curve: the layout, names, a checksum of token ids, the profile's tables
NOT_SCALARS = frozenset({"step", "layout", "compute_dtype", "matmul_flops_by_dtype", "tokens_checksum", "profile"})
WANDB_ID_FILE = "wandb_run_id"  # in --checkpoint-dir: the W&B run a resumed run continues
_WANDB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_WANDB_BAD_PROJECT = re.compile(r"[/\\#?%:]")  # characters W&B refuses in a project name


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one step record: {tag: value}, the tag its key path joined by '/'."""
    out: dict[str, float] = {}

    def walk(tag: str, value: Any) -> None:
        if isinstance(value, bool):
            out[tag] = float(value)
        elif isinstance(value, (int, float)):
            if math.isfinite(value):  # NaN/inf: null in the JSONL, no point on the curve
                out[tag] = float(value)
        elif isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{tag}/{key}", inner)

    for key, value in record.items():
        if key not in NOT_SCALARS:
            walk(key, value)
    return out


def mfu_per_token(device_name: str, compute_dtype: str | None, flops_per_token: float, devices: int) -> float | None:
    """MFU of one token per second: model FLOPs per token / (devices x the device's dense bf16 peak). None
    where no peak is known (CPU, an unlisted GPU) or the matmuls did not run in bf16 (step 1 measured)."""
    from .results import BF16_PEAK  # lazy: results imports torch, which the pre-run checks (importing this) leave out

    peak = next((v for k, v in BF16_PEAK.items() if k in device_name), None)
    if peak is None or not compute_dtype or "bfloat16" not in compute_dtype:
        return None
    return flops_per_token / (devices * peak)


def _missing(package: str, flag: str) -> str:
    return (
        f"{flag} needs the {package} package, which is not installed: pip install {package} "
        f"(or pip install -e '.[{package}]' in the tessera clone)"
    )


def check_loggers(tensorboard: str | None, wandb_project: str | None) -> None:
    """Before any rank starts: the library of each logger asked for is installed, DIR (or W&B's directory)
    can be written, the project name is one W&B takes. ValueError in one line naming the fix."""
    if tensorboard is not None:
        if importlib.util.find_spec("tensorboard") is None:
            raise ValueError(_missing("tensorboard", "--tensorboard"))
        check_writable_dir("--tensorboard", tensorboard)
    if wandb_project is not None:
        if importlib.util.find_spec("wandb") is None:
            raise ValueError(_missing("wandb", "--wandb"))
        if not wandb_project or len(wandb_project) > 128 or _WANDB_BAD_PROJECT.search(wandb_project):
            raise ValueError(
                f"--wandb {wandb_project!r} is no W&B project name: 1-128 characters, none of / \\ # ? % :"
            )
        check_writable_dir("WANDB_DIR (where --wandb writes)", os.environ.get("WANDB_DIR") or ".")


class MetricsLogger:
    """One backend: `log` a step's scalars (flushed), `close` at the end of the run."""

    def log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoardLogger(MetricsLogger):
    """Event files in `log_dir`; the events of steps >= `first_step` an earlier attempt wrote are purged, so
    a resumed (or fresh) run's curve is the one the JSONL holds."""

    def __init__(self, log_dir: str, first_step: int) -> None:
        # lazy: tensorboard is optional (the tensorboard extra); SummaryWriter needs it
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir, purge_step=first_step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger(MetricsLogger):
    """A W&B run under `run_id` (resumed when it exists): online where the user is logged in and reaches W&B,
    offline (files under WANDB_DIR, `wandb sync` uploads them) with WANDB_MODE=offline or when online fails."""

    def __init__(self, project: str, run_id: str, name: str, config: dict[str, Any]) -> None:
        import wandb  # lazy: wandb is optional (the wandb extra)

        kwargs: dict[str, Any] = dict(project=project, id=run_id, name=name, config=config, resume="allow")
        try:
            self.run = wandb.init(**kwargs, settings=wandb.Settings(init_timeout=60))
        except Exception as e:  # no login or no network: the same run, offline
            if os.environ.get("WANDB_MODE") == "offline":
                raise
            print(
                f"tessera: warning: W&B online failed ({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
                f"logging offline (upload later with wandb sync)",
                file=sys.stderr,
                flush=True,
            )
            self.run = wandb.init(**kwargs, mode="offline")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step, commit=True)

    def close(self) -> None:
        self.run.finish()


def wandb_run_id(checkpoint_dir: str | None, resumed_root: Path | None) -> str:
    """The W&B run id: the one kept beside the resumed checkpoint (so its curves continue), else a new one;
    kept in `checkpoint_dir` for the next resume. The file holds the id as text, checked against W&B's
    characters (nothing read runs)."""
    run_id = None
    if resumed_root is not None and (resumed_root / WANDB_ID_FILE).is_file():
        text = (resumed_root / WANDB_ID_FILE).read_text().strip()
        run_id = text if _WANDB_ID.fullmatch(text) else None
    run_id = run_id or uuid.uuid4().hex[:16]
    if checkpoint_dir:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        (Path(checkpoint_dir) / WANDB_ID_FILE).write_text(run_id + "\n")
    return run_id


class Loggers:
    """The loggers a run asked for (none on ranks other than 0): each step record goes to all of them."""

    def __init__(self, loggers: list[MetricsLogger]) -> None:
        self.loggers = loggers

    def log(self, record: dict[str, Any]) -> None:
        if self.loggers:
            values = scalars(record)
            for logger in self.loggers:
                logger.log(int(record["step"]), values)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def open_loggers(
    tensorboard: str | None,
    wandb_project: str | None,
    *,
    first_step: int,
    name: str,
    config: dict[str, Any],
    checkpoint_dir: str | None,
    resumed_root: Path | None,
) -> Loggers:
    """rank 0's loggers for a run whose first step is `first_step` (a resumed run: its checkpoint's + 1)."""
    loggers: list[MetricsLogger] = []
    if tensorboard is not None:
        loggers.append(TensorBoardLogger(tensorboard, first_step))
    if wandb_project is not None:
        loggers.append(WandbLogger(wandb_project, wandb_run_id(checkpoint_dir, resumed_root), name, config))
    return Loggers(loggers)

"""Checks on paths a run will write, shared by the pre-run checks (preflight) and the profiler; and the
calibration file's place and reading, shared by tessera/calibrate.py (which writes it) and `tessera plan
--device-kind` (which reads it without importing torch)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def check_writable_dir(flag: str, path: str) -> None:
    """Create directory `path` if needed, then create (and remove) a file in it; ValueError naming `flag` if
    either fails. Permission bits alone pass directories no one can write into (/proc, as root)."""
    d = Path(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be created ({e.strerror}); choose a writable directory") from None
    if not os.access(d, os.W_OK | os.X_OK):  # entries are made in a directory through both
        raise ValueError(f"{flag} {path} is not writable; choose a writable directory")
    try:
        with tempfile.NamedTemporaryFile(dir=d, prefix=".tessera-write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be written ({e.strerror}); choose a writable directory") from None


def calibration_path() -> Path:
    """The calibration file: $TESSERA_CALIBRATION, else ~/.cache/tessera/calibration.json (or under
    $XDG_CACHE_HOME)."""
    if os.environ.get("TESSERA_CALIBRATION"):
        return Path(os.environ["TESSERA_CALIBRATION"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tessera" / "calibration.json"


def read_calibration(path: str | Path | None = None) -> dict[str, Any]:
    """The calibration file's JSON (`path`, or `calibration_path()`); ValueError naming the file and the fix
    when it is missing or not JSON."""
    path = Path(path) if path else calibration_path()
    if not path.exists():
        raise ValueError(f"no calibration file at {path}; run tessera plan --calibrate --model M --seq-len S first")
    if not path.is_file():  # a device (/dev/zero) or a FIFO would be read without end
        raise ValueError(
            f"calibration file {path} is not a regular file; name the JSON file tessera plan --calibrate wrote"
        )
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(
            f"calibration file {path} is not JSON ({e}); recalibrate with tessera plan --calibrate"
        ) from None

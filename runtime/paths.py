"""Checks on paths a run will write, shared by the pre-run checks (preflight) and the profiler."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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

"""safetensors files, read and written without pickle: the format tessera exports and imports (Hugging Face
directories, full state dicts). Errors are CheckpointError, naming the file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from tessera.topology.errors import CheckpointError  # the hierarchy's: a ValueError too


# ----------------------------------------------------------------------------- DCP, read safely
def _unsafe(file, error: Exception) -> CheckpointError:
    text = str(error)
    if any(m in text.lower() for m in ("incomplete", "not fully covered", "out of bounds")):
        return CheckpointError(f"{file} is truncated or not a safetensors file ({text})")
    return CheckpointError(f"{file} is not a safetensors file: {text}")


def write_safetensors(
    tensors: dict[str, torch.Tensor], file: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """Write `tensors` (any dtype safetensors supports) to `file` atomically (a temporary file, renamed), with
    the permissions any file the process creates gets (0o666 less its umask: -rw-r--r-- under 0022, as the
    config.json beside it), not the owner-only -rw------- safetensors' own writer gives its file."""
    contiguous = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    tmp = Path(f"{file}.tmp")
    mode = _created_mode(tmp)
    save_file(contiguous, str(tmp), metadata=metadata or {})
    os.chmod(tmp, mode)
    os.replace(tmp, file)


def _created_mode(path: Path) -> int:
    """The permission bits a file created now gets (0o666 less the process umask), read by creating `path`
    (os.umask would have to change the umask to read it: a race with the process's other threads)."""
    path.unlink(missing_ok=True)  # a temporary file left by an interrupted write keeps its own mode
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)


def read_safetensors(file: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (memory-mapped while read); CheckpointError if it is damaged."""
    if not Path(file).exists():
        raise CheckpointError(f"{file}: no such file")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _unsafe(file, e) from None


def read_safetensors_header(file: str | os.PathLike) -> dict[str, Any]:
    """name -> {"dtype", "shape"} of a safetensors file, without reading any tensor data."""
    if not Path(file).exists():
        raise CheckpointError(f"{file}: no such file")
    try:
        with safe_open(str(file), framework="pt") as f:
            return {
                name: {"dtype": f.get_slice(name).get_dtype(), "shape": list(f.get_slice(name).get_shape())}
                for name in f.keys()
            }
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _unsafe(file, e) from None


def read_safetensors_slice(file: str | os.PathLike, name: str, index: tuple) -> torch.Tensor:
    """tensor[name][index] read from `file` without loading the rest (index: a tuple of slices)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return f.get_slice(name)[index]
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _unsafe(file, e) from None

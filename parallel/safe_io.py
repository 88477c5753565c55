"""Reading what a checkpoint holds without ever running code from it, and safetensors files.

DCP reads its `.metadata` with plain pickle.load and its non-tensor items with torch.load(weights_only=
False), so a crafted checkpoint could run code even with matching checksums. `SafeFileSystemReader`
reads the metadata through an unpickler that admits only DCP's metadata types; the load planners here
read non-tensor items with weights_only=True. Full state dicts are safetensors (JSON header + raw
bytes), read and written here.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded faithfully; the message names the file and the reason."""


# ----------------------------------------------------------------------------- DCP, read safely
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP metadata is made of: its metadata classes, torch.Size and dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        import torch.distributed.checkpoint.metadata as dcp_metadata

        allowed = name in _METADATA_GLOBALS.get(module, ())
        if module == "torch.distributed.checkpoint.metadata":
            allowed = isinstance(getattr(dcp_metadata, name, None), type) or name == "_MEM_FORMAT_ENCODING"
        if module == "torch":
            allowed = name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        if not allowed:
            raise CheckpointError(f"DCP metadata refers to {module}.{name}, which no DCP metadata holds: a crafted "
                                  f"file, refused (nothing read from a checkpoint may run code)")
        return super().find_class(module, name)


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's reader, with `.metadata` read by a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank")) if hasattr(self, "_get_metadata_path") else Path(self.path) / ".metadata"
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{path}: unreadable DCP metadata ({e})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_bytes_safely(planner: Any, read_item: Any, value: Any) -> None:
    try:
        obj = torch.load(value, weights_only=True)  # never runs code; DCP's default would (weights_only=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint item {read_item.dest_index.fqn} is not plain data ({e}); refused") from None
    if planner.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes does, with the safe load
        from torch.distributed.checkpoint._traverse import set_element

        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: Any) -> None:
        _load_bytes_safely(self, read_item, value)


class _SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    def load_bytes(self, read_item: Any, value: Any) -> None:
        _load_bytes_safely(self, read_item, value)


# ----------------------------------------------------------------------------- safetensors
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64"}


def write_safetensors(tensors: dict[str, torch.Tensor], file: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """The safetensors format (an 8-byte header length, a JSON header, the raw little-endian data);
    written here rather than adding a dependency for ~20 lines."""
    header: dict[str, Any] = {"__metadata__": metadata or {}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} is not supported for export")
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = Path(f"{file}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)
    os.replace(tmp, file)


def read_safetensors(file: str | os.PathLike) -> dict[str, torch.Tensor]:
    by_name = {v: k for k, v in _DTYPES.items()}
    raw = Path(file).read_bytes()
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not a safetensors file: {e}") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, stop = info["data_offsets"]
        if 8 + n + stop > len(raw):
            raise CheckpointError(f"{file} is truncated: tensor {name} ends past the end of the file")
        buf = bytearray(raw[8 + n + start : 8 + n + stop])
        dtype = by_name[info["dtype"]]
        out[name] = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(info["shape"]) if buf else torch.empty(info["shape"], dtype=dtype)
    return out


def read_safetensors_header(file: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a safetensors file (names, dtypes, shapes), without reading any tensor data."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 * 2**20:
                raise CheckpointError(f"{file} is not a safetensors file: header of {n} bytes")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such file") from None
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not a safetensors file: {e}") from None
    header.pop("__metadata__", None)
    return header



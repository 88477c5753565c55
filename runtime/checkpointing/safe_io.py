"""Reading what a checkpoint holds without ever running code from it, and safetensors files.

DCP reads its `.metadata` with plain pickle.load and its non-tensor items with torch.load(weights_only=
False), so a crafted checkpoint could run code even with matching checksums. `SafeFileSystemReader`
reads the metadata through an unpickler that admits only DCP's metadata types; the load planners here
read non-tensor items with weights_only=True. Full state dicts are safetensors files, through the
safetensors library (a JSON header and raw bytes: nothing in them can run).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

# the safetensors side lives with the models (Hugging Face files are read there); re-exported here
from tessera.models.safetensors_io import (
    CheckpointError,
    read_safetensors,
    read_safetensors_header,
    read_safetensors_slice,
    write_safetensors,
)

__all__ = [
    "CheckpointError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "read_safetensors",
    "read_safetensors_header",
    "read_safetensors_slice",
    "write_safetensors",
]


_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP metadata is made of: its metadata classes, torch.Size and dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _METADATA_GLOBALS.get(module, ())
        if module == "torch.distributed.checkpoint.metadata":
            allowed = isinstance(getattr(dcp_metadata, name, None), type) or name == "_MEM_FORMAT_ENCODING"
        if module == "torch":
            allowed = name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        if not allowed:
            raise CheckpointError(
                f"DCP metadata refers to {module}.{name}, which no DCP metadata holds: a crafted "
                f"file, refused (nothing read from a checkpoint may run code)"
            )
        return super().find_class(module, name)


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's reader, with `.metadata` read by a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = (
            self._get_metadata_path(kwargs.get("rank"))
            if hasattr(self, "_get_metadata_path")
            else Path(self.path) / ".metadata"
        )
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
# The safetensors library: every dtype it knows, memory-mapped reads, and slices of one tensor without
# reading the rest (what a rank needs to take only its shard of a large file).

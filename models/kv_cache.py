"""The key/value cache of incremental decoding, one per attention block, in the block's `kv_cache` slot.

An attention block with the slot (models/attention.py's GroupedQueryAttention; any block that names it)
passes its rotated keys and values of the new tokens through `self.kv_cache` when one is installed: the
cache writes them after the ones it holds and returns every key and value so far, so the block attends
the new queries to the whole prefix. The new tokens are the last of the sequence, which is what the
attention op's causal mask aligned bottom-right means (tessera.kernels.flash_attention), and the caller
passes their absolute positions (`next_positions`), so RoPE rotates them where they are.

Nothing here knows a family or a parallelism: a block's keys are whatever heads its rank holds (all of
them on one process, n_kv_heads / tp under tensor parallel), so the same cache serves every family and
layout whose attention has the slot. The buffers are plain attributes, not registered: a model's state
dict, parameters and checkpoints are the same with caches installed.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    """Keys and values (B, H, S, D) of up to `capacity` positions, allocated at the first write (the dtype,
    device and head count of the block's own keys)."""

    def __init__(self, capacity: int):
        super().__init__()
        if capacity < 1:
            raise ValueError(f"a KV cache of capacity {capacity}: it must hold at least one position")
        self.capacity = capacity
        self.length = 0  # positions written so far
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def forward(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new tokens' k, v (B, H, S_new, D); return every cached position's (B, H, length, D)."""
        if self.keys is None or self.values is None:
            B, H, _, D = k.shape
            self.keys = k.new_empty(B, H, self.capacity, D)
            self.values = v.new_empty(B, v.shape[1], self.capacity, v.shape[-1])
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(
                f"the KV cache holds {self.capacity} positions; writing {k.shape[2]} after {self.length} passes it"
            )
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def extra_repr(self) -> str:
        return f"capacity={self.capacity}, length={self.length}"


def cache_slots(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` with a `kv_cache` slot (its attention blocks), in order."""
    return [m for m in model.modules() if hasattr(m, "kv_cache") and not isinstance(m, KVCache)]


@contextlib.contextmanager
def kv_caches(model: nn.Module, capacity: int) -> Iterator[list[KVCache]]:
    """Install an empty KVCache of `capacity` positions in every attention block's slot for the `with`
    block, and take them out after it (the model is as it was). ValueError for a model with no slot."""
    slots = cache_slots(model)
    if not slots:
        raise ValueError(
            f"{type(model).__name__} has no attention block with a kv_cache slot (models/kv_cache.py); "
            f"generate without the cache (use_cache=False)"
        )
    caches = [KVCache(capacity) for _ in slots]
    for slot, cache in zip(slots, caches):
        slot.kv_cache = cache
    try:
        yield caches
    finally:
        for slot in slots:
            setattr(slot, "kv_cache", None)  # the slot empty again (nn.Module unregisters the cache)


def next_positions(caches: list[KVCache], new: int, device: torch.device | str) -> Tensor:
    """The absolute positions (new,) of the next `new` tokens: after the ones the caches hold."""
    lengths = {c.length for c in caches}
    if len(lengths) != 1:
        raise ValueError(f"the KV caches hold different lengths {sorted(lengths)}: a forward was cut short")
    start = lengths.pop()
    return torch.arange(start, start + new, device=device)

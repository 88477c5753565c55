"""The FP8 casts a model's sibling linear layers share in an eager step: q, k and v read one normed input, gate
and up another, and under torchao's float8 linear each layer casts it for itself, an amax reduction and a scaled
cast each, in the forward and again in the backward (the input of the weight gradient). The casts are the same
bits (one tensor, one cast config, one scale), so the first layer's serves the next ones: per block, 2 casts of
each shared input instead of 6 (attention) or 4 (the MLP), and its amax found once for the forward and the
backward. The scale of a linear's input is its tensor's (tensorwise: one; rowwise: one per token, or per feature
for the weight gradient), so what a layer rounds is unchanged; tests/test_fp8_shared_casts.py holds every
gradient to the unshared run bit for bit and counts the casts.

A cast is shared only with the tensor it was made from: held with a weak reference to it and its version
counter, found again only while it is the same tensor object, unchanged (a new tensor at a freed one's address
is not it). A cast is held only for its readers (its siblings: a layer that reads its input alone holds none),
and the last of them takes it out; at most `capacity` are held at once, for readers that never came. The amax of
an input lives on the tensor itself (as kernels/fp8_amax.py's row amaxes do), from the forward to the backward.
Under activation checkpointing the backward's saved inputs are detached copies, one per layer, so only the
forward's (and the recompute's) casts are shared there.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

from torch import Tensor

_WHOLE_AMAX = "_tessera_whole_amax"


class CastShare:
    """The last `capacity` casts of a model's linear inputs, found again by their tensor (module doc). One per
    model, shared by its Float8Matmuls; thread-safe (a simulated pipeline runs its stages in threads)."""

    def __init__(self, capacity: int = 4):
        if capacity < 1:
            raise ValueError(f"CastShare: capacity={capacity} must be at least 1")
        self.capacity = capacity
        self.hits = 0  # casts served from the share, and made (counted for tests and the profile)
        self.made = 0
        self._held: OrderedDict[tuple, tuple[weakref.ref, int, Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, source: Tensor, key: tuple) -> Any | None:
        """The cast of `source` made under `key`, or None."""
        with self._lock:
            entry = self._held.get((id(source), *key))
            if entry is None:
                return None
            ref, version, cast, uses = entry
            if ref() is not source or source._version != version:
                del self._held[(id(source), *key)]
                return None
            self.hits += 1
            if uses <= 1:  # its last reader
                del self._held[(id(source), *key)]
            else:
                self._held[(id(source), *key)] = (ref, version, cast, uses - 1)
            return cast

    def __len__(self) -> int:
        return len(self._held)

    def put(self, source: Tensor, key: tuple, cast: Any, uses: int) -> None:
        """Hold `cast`, made from `source` under `key`, for the `uses` sibling layers that will ask for it: the
        last of them takes it out, so nothing is held past its readers (the oldest held one goes past capacity,
        where a reader never came: under activation checkpointing the backward's saved inputs are copies)."""
        with self._lock:
            self.made += 1
            self._held[(id(source), *key)] = (weakref.ref(source), source._version, cast, uses)
            self._held.move_to_end((id(source), *key))
            while len(self._held) > self.capacity:
                self._held.popitem(last=False)


def whole_amax(source: Tensor) -> Tensor | None:
    """max |source| over all of it, as noted by remember_whole_amax, or None (none noted, or changed since)."""
    held = getattr(source, _WHOLE_AMAX, None)
    return None if held is None or held[0] != source._version else held[1]


def remember_whole_amax(source: Tensor, amax: Tensor) -> None:
    """Note max |source| (a 0-d tensor) on the tensor, for its next casts (the backward's)."""
    setattr(source, _WHOLE_AMAX, (source._version, amax))

"""Peak tensor memory on CPU (or any device): the storage of live tensors, measured, not summed from a model.

`LiveTensorBytes` is a TorchDispatchMode. Every operator's outputs are tracked by weak reference (freed
storages drop out) and the total is re-read around each operator, so storages resized in place (FSDP2
frees its gathered parameters so) count at their size at that moment. Register the tensors that exist
before the mode starts (parameters, buffers, optimizer state) with `track_existing`. torch's MemTracker
gives the same figures where it runs but refuses a module called once per microbatch. Re-reading every
storage per operator is slow: it is for one measured step (`tessera train --track-memory`), not for training.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, weakref.ref] = {}
        self.now = 0
        self.peak = 0

    def track(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.live:
            self.live[key] = weakref.ref(storage)
            weakref.finalize(storage, self.live.pop, key, None)

    def track_existing(self, modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        for module in modules:
            for t in list(module.parameters()) + list(module.buffers()):
                self.track(t)
                if t.grad is not None:
                    self.track(t.grad)
        for optimizer in optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        self.track(value)
        self.measure()

    def measure(self) -> None:
        self.now = sum(s.nbytes() for s in (ref() for ref in list(self.live.values())) if s is not None)
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.measure()
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        self.measure()
        return out

"""tessera: 4D parallelism (FSDP2 data, tensor, pipeline, context) for transformer training on one DeviceMesh.

The subpackages are tessera.topology (layouts, meshes, memory models), tessera.parallel (one module
per axis and their composition), tessera.kernels (Triton kernels beside torch references) and
tessera.models (the model families, composed from shared blocks, knowing nothing of parallelism). This
package holds the runtime, by concern: tessera.training (the config, preflight, the trainer and its runners,
a run from start to its records), tessera.metrics (what a run measured: matmul dtypes, memory, profiles,
result files), tessera.commands (the `tessera` command and its subcommands) and tessera.testing (the users'
equivalence runner and pytest plugin). tessera.config, tessera.trainer and tessera.cli keep their public
names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

try:
    __version__ = version("tessera-4d")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]

# The runtime's modules before milestone 4 split it into folders: each old name imports the module where it
# lives now, the same module object (so `monkeypatch.setattr(tessera.run, ...)` patches what runs)
MOVED = {
    **{f"tessera.{m}": f"tessera.training.{m}" for m in ("preflight", "runners", "batches", "optim", "parts", "run")},
    **{f"tessera.{m}": f"tessera.training.{m}" for m in ("estimate", "layout_names", "straggler")},
    **{f"tessera.{m}": f"tessera.metrics.{m}" for m in ("dtype_probe", "memtrack", "step_profile", "profiling")},
    "tessera.results": "tessera.metrics.results",
    "tessera.bench": "tessera.commands.bench",
    "tessera.baseline": "tessera.commands.baseline",
    "tessera.calibrate": "tessera.commands.calibrate",
    "tessera.plan_command": "tessera.commands.plan",
    "tessera.tokenize_files": "tessera.commands.tokenize",
    "tessera.pytest_plugin": "tessera.testing.pytest_plugin",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of MOVED (after every other finder: a real module of that name would win)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])  # its own __name__, __spec__ and __file__ are kept

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed under its new name


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())

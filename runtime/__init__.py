"""tessera: 4D parallelism (FSDP2 data, tensor, pipeline, context) for transformer training on one DeviceMesh.

The subpackages are tessera.topology (layouts, meshes, shapes, hardware; the estimators and the pipeline
schedules each a subpackage of it), tessera.parallel (one module per axis and their composition),
tessera.kernels (Triton kernels beside torch references) and tessera.models (the model families, composed from
shared blocks, knowing nothing of parallelism). This package holds the runtime, by concern: tessera.training
(the config, preflight, the trainer and its runners, a run from start to its records), tessera.data (what a
run reads), tessera.checkpointing (checkpoints, safe reads, locks), tessera.launching (starting ranks),
tessera.metrics (what a run measured), tessera.commands (the `tessera` command and its subcommands) and
tessera.testing (the users' equivalence runner and pytest plugin). tessera.config, tessera.trainer and
tessera.cli are the public names of the config, the trainer and the command.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tessera-4d")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]

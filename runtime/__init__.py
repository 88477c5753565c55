"""tessera: 4D parallelism (FSDP2 data, tensor, pipeline, context) for transformer training on one DeviceMesh.

The subpackages are tessera.topology (layouts, meshes, memory models), tessera.parallel (one module
per axis and their composition), tessera.kernels (Triton kernels beside torch references) and
tessera.models (a parallelism-agnostic Llama-style decoder). This package holds the runtime: the
config, the trainer and its runners, the checkpoint manager and the `tessera` command.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tessera-4d")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]

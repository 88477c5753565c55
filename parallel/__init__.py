"""One module per parallel axis (tensor, data, pipeline, context), their composition, and checkpoints."""

from .parallelize import ParallelConfig, parallelize

__all__ = ["ParallelConfig", "parallelize"]

"""One module per parallel axis (tensor, data, pipeline, context), their composition, the loss and checkpoints."""

from .parallelize import ParallelConfig, materialize, parallelize

__all__ = ["ParallelConfig", "materialize", "parallelize"]

"""One module per parallel axis (tensor, data, pipeline, context), their composition, and checkpoints."""

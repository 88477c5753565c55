"""`from tessera.trainer import Trainer`: the trainer's public name (it lives in tessera.training.training_loop)."""

from tessera.training.training_loop import *  # noqa: F403  (every public name, importable from here as before the split)
from tessera.training.training_loop import Trainer  # noqa: F401  (named for readers and type checkers)

"""`from tessera.trainer import Trainer`: the trainer's public name (it lives in tessera.training.trainer)."""

from tessera.training.trainer import *  # noqa: F403  (every public name, importable from here as before the split)
from tessera.training.trainer import Trainer  # noqa: F401  (named for readers and type checkers)

"""`from tessera.config import Config`: the training config's public name (it lives in tessera.training.run_config)."""

from tessera.training.run_config import *  # noqa: F403  (every public name, importable from here as before the split)
from tessera.training.run_config import Config  # noqa: F401  (named for readers and type checkers)

"""`python -m tessera.cli` (as torchrun runs it: `torchrun ... -m tessera.cli train ...`) and
`from tessera.cli import main, build_parser`: the `tessera` command (it lives in tessera.commands.main)."""

import sys

from tessera.commands.main import *  # noqa: F403  (every public name, importable from here as before the split)
from tessera.commands.main import build_parser, main  # noqa: F401  (named for readers and type checkers)

if __name__ == "__main__":
    sys.exit(main())

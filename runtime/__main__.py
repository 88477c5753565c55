"""`python -m tessera ...` is the `tessera` command."""

import sys

from tessera.commands.cli import main

sys.exit(main())

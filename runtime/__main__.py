"""`python -m tessera ...` is the `tessera` command."""

import sys

from .cli import main

sys.exit(main())

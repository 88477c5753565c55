"""`python -m tessera ...` is the `tessera` command."""

from tessera.commands.cli import run

run()

"""`python -m tessera ...` is the `tessera` command."""

from tessera.commands.main import run

run()

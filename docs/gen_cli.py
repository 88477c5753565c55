"""Writes docs/cli.md: every `tessera <command> --help` page, as the installed command prints it.

    python docs/gen_cli.py          # rewrite docs/cli.md
    python docs/gen_cli.py --check  # exit 1 if docs/cli.md differs from what the command prints now

tests/test_docs.py fails when docs/cli.md is stale, so a changed flag or help text comes with its page. The
pages are rendered in this process from the command's own parser (`tessera.cli.build_parser`), at 100
columns and without colour, so they do not depend on the terminal that runs this; argparse's layout may
still differ between Python versions (this page is written with the project's, 3.11)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "cli.md"
COLUMNS = 100

HEADER = """# CLI reference

Every `tessera` command's `--help`, generated from the command itself by `docs/gen_cli.py` (do not edit this
page: run `python docs/gen_cli.py` after changing a flag; `tests/test_docs.py` fails while it is stale).
What the flags do in practice: [training](training.md), [layouts and the planner](layouts.md),
[benchmarks](benchmarks.md), [data](data.md), [checkpoints and reliability](reliability.md).
"""


@contextlib.contextmanager
def _plain_terminal():
    """argparse reads the width from COLUMNS when it formats; Python 3.14's colours are off without a tty or
    with NO_COLOR, set here too."""
    saved = {k: os.environ.get(k) for k in ("COLUMNS", "NO_COLOR", "PYTHON_COLORS")}
    os.environ.update(COLUMNS=str(COLUMNS), NO_COLOR="1", PYTHON_COLORS="0")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pages() -> list[tuple[str, str]]:
    """(command line, help text) of `tessera` and each of its commands, in the parser's order."""
    from tessera.cli import build_parser  # lazy: `--help` of this script needs no tessera

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    with _plain_terminal():
        out = [("tessera", parser.format_help())]
        out += [(f"tessera {name}", p.format_help()) for name, p in sub.choices.items()]
    return out


def render() -> str:
    """The whole page, as docs/cli.md holds it."""
    helps = pages()
    parts = [HEADER]
    parts.append("Commands: " + ", ".join(f"[`{cmd}`](#{cmd.replace(' ', '-')})" for cmd, _ in helps[1:]) + ".\n")
    for cmd, text in helps:
        parts.append(f"## {cmd}\n\n```text\n$ {cmd} --help\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is stale, writing nothing")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python docs/gen_cli.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

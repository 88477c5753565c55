"""Imports go at the top of a module. A function-level import is allowed only where one is needed (an import
cycle, an optional dependency such as triton or matplotlib, or keeping torch out of topology and of the
torch-free commands), and says why: a comment beginning `# lazy: ` on its line or the line just above, or on
the line above the first import of a consecutive block of imports (one comment covers the block, isort's
blank-line groups included).

The check reads the package's source folders (runtime/, parallel/, models/, kernels/, topology/) with ast
and tokenize; nothing is imported.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("runtime", "parallel", "models", "kernels", "topology")
MARK = "# lazy:"

_Import = (ast.Import, ast.ImportFrom)


def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    return out


def _statement_lists(node: ast.AST):
    """The statement lists directly under `node` (a body, an else, a finally, each except's body)."""
    for name in ("body", "orelse", "finalbody"):
        stmts = getattr(node, name, None)
        if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
            yield stmts
    for handler in getattr(node, "handlers", None) or []:
        yield handler.body
    for case in getattr(node, "cases", None) or []:
        yield case.body


def function_level_imports(source: str) -> list[tuple[int, bool]]:
    """(line, has its `# lazy:` reason) of each import statement inside a function, in line order."""
    tree = ast.parse(source)
    comments = _comments(source)

    def marked(line: int) -> bool:
        return comments.get(line, "").startswith(MARK)

    found: dict[int, bool] = {}
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            for stmts in _statement_lists(node):
                block: list[ast.stmt] = []  # the consecutive imports up to this one (blank lines between)
                for stmt in stmts:
                    if not isinstance(stmt, _Import):
                        block = []
                        continue
                    block.append(stmt)
                    found[stmt.lineno] = any(
                        marked(line) for line in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
                    ) or any(marked(s.lineno - 1) for s in block)
    return sorted(found.items())


def unexplained(root: Path = ROOT, folders: tuple[str, ...] = FOLDERS) -> list[str]:
    """file:line of every function-level import without its `# lazy:` reason."""
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            for line, ok in function_level_imports(path.read_text()):
                if not ok:
                    out.append(f"{path.relative_to(root)}:{line}")
    return out


def test_every_function_level_import_says_why_it_is_not_at_the_top():
    missing = unexplained()
    assert not missing, (
        f"{len(missing)} function-level import(s) without a `# lazy: <why>` comment; move each to the top of "
        "its module, or say why it must stay (a cycle, an optional dependency, torch kept out):\n  "
        + "\n  ".join(missing)
    )


def test_the_check_reads_same_line_line_above_and_block_comments():
    source = """
import os


def f():
    import json  # lazy: on its line
    # lazy: on the line above
    import csv

    # lazy: one comment, the whole block (isort's groups included)
    import torch
    from torch import nn

    from tessera import config
    x = 1
    import re
    try:  # lazy: optional
        import matplotlib
    except ImportError:
        import shutil

    def inner():
        from pathlib import (  # lazy: a parenthesized one
            Path,
        )
        import glob
"""
    lines = source.splitlines()
    said = {lines[line - 1].strip(): ok for line, ok in function_level_imports(source)}
    assert said == {
        "import json  # lazy: on its line": True,
        "import csv": True,
        "import torch": True,
        "from torch import nn": True,
        "from tessera import config": True,
        "import re": False,  # after a statement: a block of its own, without a reason
        "import matplotlib": True,
        "import shutil": False,
        "from pathlib import (  # lazy: a parenthesized one": True,
        "import glob": False,  # a comment on the first import covers that one only
    }


if __name__ == "__main__":  # the list, one file:line a line
    print("\n".join(unexplained()))

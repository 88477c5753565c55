"""The Python API's values checked against their sections' declared types, before any other check reads
them: `Config.create` takes any value, where the CLI's parser types its own (steps=2.5 trained; lr="0.1" met a
bare TypeError in a comparison)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from tessera.topology.errors import ConfigError

# (a str field takes a path object too: the paths a caller holds as pathlib.Path)
_SIMPLE = {"int": (int,), "float": (float, int), "str": (str, os.PathLike), "bool": (bool,), "None": (type(None),)}


def _accepted(hint: str) -> tuple[type, ...] | None:
    """The types a field annotated `hint` (a section's annotation, a string) takes: its simple types (a float
    takes an int too), None where it allows None; None where the annotation is not simple (a tuple, a list)."""
    out: tuple[type, ...] = ()
    for part in (p.strip() for p in hint.split("|")):
        if part not in _SIMPLE:
            return None
        out += _SIMPLE[part]
    return out


def check_types(*sections: Any) -> None:
    """Every section field of its declared type: the Python API takes any value where the CLI's parser types
    its own (steps=2.5 trained, lr="0.1" met a bare TypeError in a comparison). An int field takes an int (not
    a bool or a float), a float field a number, a str field a str, a bool field a bool, None where allowed."""
    for section in sections:
        for f in dataclasses.fields(section):
            accepted = _accepted(str(f.type))
            value = getattr(section, f.name)
            if accepted is None or (
                isinstance(value, accepted) and not (isinstance(value, bool) and bool not in accepted)
            ):
                continue
            wanted = " or ".join(
                "a number" if t is float else _a(t.__name__)
                for t in accepted
                if t not in (type(None), os.PathLike) and not (t is int and float in accepted)
            )
            raise ConfigError(f"{f.name}={value!r} must be {wanted}, not {_a(type(value).__name__)}")


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"

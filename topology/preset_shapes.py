"""The registered presets' ModelShapes as data (topology/preset_shapes.json), so that `tessera plan` resolves a
preset name without importing torch (tessera.models builds the families' modules; importing it took 1.4 s of a
2.1 s `--top 0`). The file is written from the families' own specs (`python tests/test_preset_shapes.py
--write`) and a test holds it equal to them, preset by preset."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from tessera.topology.shapes import ModelShape

SHAPES_FILE = Path(__file__).with_name("preset_shapes.json")


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, dict]:
    if not SHAPES_FILE.is_file():
        return {}
    data = json.loads(SHAPES_FILE.read_text())
    return data.get("shapes", {}) if isinstance(data, dict) else {}


def preset_shape(name: str) -> ModelShape | None:
    """The shape of preset `name` (None: not in the table; the caller asks the families)."""
    fields = _table().get(name.lower())
    if fields is None:
        return None
    known = {f.name: f for f in dataclasses.fields(ModelShape)}
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items() if k in known}
    return ModelShape(**values)


def shapes_document(shapes: dict[str, ModelShape]) -> dict:
    """The file's contents for `shapes` (the writer's side)."""
    return {
        "schema": 1,
        "about": "tessera's presets as ModelShapes (topology/shapes.py), written by python tests/test_preset_shapes.py "
        "--write from the families' specs; `tessera plan` reads them without importing torch",
        "shapes": {name: dataclasses.asdict(shape) for name, shape in sorted(shapes.items())},
    }

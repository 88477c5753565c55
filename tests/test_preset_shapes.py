"""topology/preset_shapes.json: every registered preset's ModelShape as the families compute it, so that
`tessera plan` resolves a preset without importing torch. `python tests/test_preset_shapes.py --write` writes it."""

from __future__ import annotations

import json
import sys

from tessera.models.spec import all_presets, shape_of
from tessera.topology.preset_shapes import SHAPES_FILE, preset_shape, shapes_document


def test_every_preset_shape_in_the_table_is_the_familys():
    names = sorted(all_presets())
    for name in names:
        assert preset_shape(name) == shape_of(name), f"{name}: run python tests/test_preset_shapes.py --write"
    assert sorted(json.loads(SHAPES_FILE.read_text())["shapes"]) == names


def test_plan_resolves_a_preset_without_importing_torch():
    import subprocess

    code = (
        "import sys; from tessera.commands.main import main; "
        "code = main(['plan', '--model', '8b', '--gpus', '8', '--seq-len', '8192', '--global-batch', '16', "
        "'--layout', 'dp8+ac_op', '--top', '0', '--json']); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_preset_shapes.py --write   (writes topology/preset_shapes.json)")
    SHAPES_FILE.write_text(json.dumps(shapes_document({n: shape_of(n) for n in all_presets()}), indent=1) + "\n")
    print(f"wrote {SHAPES_FILE}")

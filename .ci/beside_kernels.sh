#!/usr/bin/env bash
# tessera installs beside the PyPI `kernels` distribution (Hugging Face's): a fresh venv with `kernels`
# installed first, then tessera (a regular, non-editable install); both must import, each its own.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="$(mktemp -d)/venv"
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
pip install -q torch==2.13.0        # the CPU build on disk first: nothing below may pull a CUDA build
pip install -q kernels
pip install -q "$repo"
cd "$(mktemp -d)"                    # away from the source tree: only installed packages import
python - <<'PY'
import importlib.metadata as md

import kernels
import tessera
import tessera.kernels
from tessera.kernels import flash_attention, rms_norm

assert "site-packages" in kernels.__file__ and hasattr(kernels, "get_kernel"), kernels.__file__
assert "site-packages" in tessera.kernels.__file__, tessera.kernels.__file__
import torch
q = torch.randn(1, 2, 8, 16)
assert flash_attention(q, q, q).shape == q.shape
print(f"ok: kernels {md.version('kernels')} at {kernels.__file__}; tessera-4d {md.version('tessera-4d')} at {tessera.__file__}")
PY
rm -rf "$(dirname "$venv")"

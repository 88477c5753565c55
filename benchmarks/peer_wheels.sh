#!/usr/bin/env bash
# The wheels bench_peer.py needs on the GPU machine (Python 3.12, no package index there): torchtitan 0.2.2 (the
# release that runs on its torch 2.11), the packages torchtitan imports that the machine's image lacks, and torchao
# for the FP8 rows; into build/wheels (git-ignored) or the folder named, for the device call to carry and install
# with `python -m pip install -q --no-deps build/wheels/*.whl`. The versions are those the CPU checks ran with.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-build/wheels}
mkdir -p "$dest"
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dest" \
  torchtitan==0.2.2 torchdata==0.11.0 datasets==4.7.0 multiprocess==0.70.18 dill==0.4.0 tyro==1.0.17 \
  docstring-parser==0.18.0 typeguard==4.6.1 tomli==2.3.0 torchao==0.18.0
du -sh "$dest"

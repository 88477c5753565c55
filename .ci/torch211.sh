#!/usr/bin/env bash
# The GPU machines' stack beside the main suite's (torch 2.13 + triton 3.9): torch 2.11 + triton 3.6 in a venv
# of their own, tessera with its test extra, then the fast tier and the fp32, bf16, Muon and FP8 contracts (not the whole
# slow tier: 20 minutes more). PyPI's torch 2.11 is the CUDA build (no CPU wheel of it reaches this machine):
# its CUDA packages (~3 GB) come along and it runs on the CPU. Measured on 2 cores: install ~1.5 min, tests ~9.
set -euxo pipefail
cd "$(dirname "$0")/.."
venv=build/venv-torch211 # build/ is git-ignored, so ruff and git pass it by
# Disk: the install peaks at 6.3 GB (measured: a 4.7 GB venv and pip's unpacked wheels) and the tests add their
# caches; a CI run on record ran out of disk in this install after the main suite had passed. Where the machine
# has not the room, this stage says so and is skipped: the project's own suite has run by then, and a host's
# disk is no finding about tessera
need_mb=${TORCH211_NEED_MB:-8000}
free_mb=$(df --output=avail -BM . | tail -1 | tr -dc 0-9)
if ((free_mb < need_mb)); then
  echo "SKIPPED: the torch 2.11 + triton 3.6 stage needs ${need_mb} MB of free disk, ${free_mb} MB are free here" >&2
  exit 0
fi
python3 -m venv --clear "$venv"
. "$venv/bin/activate"
# one resolve with the pins, so that the test extra cannot move torch or triton. pip byte-compiles what it installs
# (~25 s of CPU once): where the environment sets PYTHONDONTWRITEBYTECODE (this machine does), a process could not
# keep what it compiled, and every test process and forkserver compiled torch's modules anew (~5 s of CPU each:
# `import torch.distributed.tensor` 7.4 s without the bytecode, 2 s with it)
# --no-cache-dir: a wheel that comes over the network is not kept a second time in pip's cache
pip install -q --no-cache-dir torch==2.11.0 triton==3.6.0 -e ".[test]"
python - <<'PY'
import torch, triton

assert torch.__version__.split("+")[0] == "2.11.0" and triton.__version__ == "3.6.0", (torch.__version__, triton.__version__)
PY
python -m pytest -q -p no:cacheprovider -m "not slow"
# the tests moved from the fast tier to the slow one for time whose subject differs between torch versions (custom ops'
# fakes, what torch imports, DeviceMesh on gloo ranks)
python -m pytest -q -p no:cacheprovider -m slow tests/test_kernels.py tests/test_public_names.py tests/test_mesh.py \
  -k "custom_ops_have_fake or import_no_dynamo or gloo_ranks or sharing_one_world_mesh"
# torchtitan's peer (benchmarks/bench_peer.py --check): the release the GPU machines' torch 2.11 runs
python -m pytest -q -p no:cacheprovider tests/test_peer.py
python -m pytest -q -p no:cacheprovider tests/test_contract.py tests/test_contract_bf16.py tests/test_muon_contract.py tests/test_fp8_contract.py
# the new families and the attention variants under cp, fp32 rows (their bf16 rows run on 2.13 above; on 2.11 gpt-oss's
# tp2 + SP rows exceed the derived bound on one sinks gradient: open, in the stop note)
python -m pytest -q -p no:cacheprovider tests/test_contract_families.py tests/test_context_variants.py -k "not in_bf16"

#!/usr/bin/env bash
# A whole GPU lease's measurements in one device call: the GPU suite, then tessera against torchtitan on the same
# GPU (bench_peer.py), so that neither waits for a second machine start (each start took about 75 s of the
# 15-minute lease on 2026-12-04). Run from the repository root with build/wheels carried
# (bash benchmarks/peer_wheels.sh first) and timeout_s 590: the suite within SUITE_BUDGET_S (default 330; a part
# that would not fit is skipped and named), the four peer rows within PEER_S (default 200). What comes back, at
# most 8 files: $OUT/gpu (the suite's JSON, log and three plots) and $OUT/peer (the peer JSON and its log).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder the results come back from}"
mkdir -p "$OUT/gpu" "$OUT/peer"
python -m pip install -q --no-deps build/wheels/*.whl || echo "gpu_lease: the wheels did not install (no fp8, no peer)"
python -m pip install -q --no-deps --no-build-isolation . || exit 1
python benchmarks/gpu_suite.py --budget-s "${SUITE_BUDGET_S:-330}" --out "$OUT/gpu" 2>&1 | tee "$OUT/gpu/suite.log" | tail -40
timeout "${PEER_S:-200}" python benchmarks/bench_peer.py --timeout 90 --out "$OUT/peer" 2>&1 | tee "$OUT/peer/peer.log" | tail -12
echo "gpu_lease: done"

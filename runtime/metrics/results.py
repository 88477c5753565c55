"""What every benchmark result carries beside its figures: the device, the versions, the configuration."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tessera.topology.estimators.fp8_model import blended_peak

# peak HBM bandwidth in bytes/s, by a substring of torch.cuda.get_device_name()
HBM_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 80GB HBM3": 3.35e12,
    "H100 SXM": 3.35e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "A100": 2.0e12,
}
# dense bf16 peak FLOP/s, by a substring of the device name
BF16_PEAK = {
    "H200": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "A100": 312e12,
}


def mfu_by_dtype(flops: float, step_s: float, devices: int, peak: float | None, by_dtype: dict | None) -> dict:
    """MFU where it is defined, by the dtypes the matmuls ran in (the records' probe, `matmul_flops_by_dtype`):
    a row whose matmuls ran in bf16 (or fp32, against a CPU's measured fp32 rate) against `peak`; a row with FP8
    matmuls against the FP8 dense peak (twice the bf16 one on the datasheets of H100 and H200) and against a peak
    blended by the share of matmul FLOPs that ran in FP8, both named, and no bf16-peak MFU (it overstated FP8
    rows: 64.7% where the FP8 peak gives 32.3%). Emulated FP8 (CPU) has no FP8 peak: no MFU."""
    if not peak or not step_s:
        return {"mfu": None}
    flops_by = {k: float(v) for k, v in (by_dtype or {}).items() if isinstance(v, (int, float))}
    fp8 = sum(v for k, v in flops_by.items() if k.startswith("float8"))
    if not fp8:
        return {"mfu": flops / (step_s * devices * peak)}
    if any(k == "float8_emulated" for k in flops_by):
        return {"mfu": None, "mfu_note": "FP8 emulated in fp32 on CPU: no FP8 peak to measure it against"}
    share = fp8 / sum(flops_by.values())
    fp8_peak = 2 * peak
    blended = blended_peak(share, peak, fp8_peak)
    return {
        "mfu": None,
        "mfu_fp8_peak": flops / (step_s * devices * fp8_peak),
        "mfu_fp8_blended_peak": flops / (step_s * devices * blended),
        "fp8_matmul_flop_share": share,
    }


def finite_or_null(value: Any) -> Any:
    """`value` with every NaN and infinity (in nested dicts and lists too) replaced by None: JSON has no
    such numbers, and Python's json writes them as bare NaN / Infinity, which strict parsers refuse."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def strict_json(value: Any) -> str:
    """One line of strict JSON: NaN and infinity written as null (json.dumps(..., allow_nan=False) holds)."""
    return json.dumps(finite_or_null(value), allow_nan=False)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu": cpu_name(), "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        info.update(
            device=name,
            gpu_memory_bytes=props.total_memory,
            sm_count=props.multi_processor_count,
            hbm_bandwidth_bytes_per_s=next((v for k, v in HBM_BANDWIDTH.items() if k in name), None),
        )
    else:
        info["device"] = info["cpu"]
    return info


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform()}
    try:
        import triton  # lazy: triton is optional (Linux only, and not needed on CPU)

        out["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    return out


def write_results(name: str, config: dict[str, Any], results: Any, out: str | Path) -> Path:
    """Write the JSON to OUT: a file path, or a directory (created if it does not end in .json) that gets NAME.json."""
    path = Path(out)
    if path.suffix != ".json":
        path = path / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": device_info(),
        "versions": versions(),
        "config": config,
        "results": results,
    }
    path.write_text(json.dumps(payload, indent=1))
    return path

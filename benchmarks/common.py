"""What every benchmark writes beside its figures: the device, the versions, the configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessera.results import HBM_BANDWIDTH, cpu_name, device_info, versions  # noqa: F401 (re-exported)
from tessera.results import write_results as _write

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, config: dict[str, Any], results: Any, out: str | None = None) -> Path:
    """Write the JSON to OUT: a file path, or a directory that gets NAME.json (default benchmarks/results/)."""
    return _write(name, config, results, out or RESULTS)

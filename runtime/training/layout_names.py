"""Layout names, as `tessera bench` and `tessera plan --layout` take them: 'pp2xdp2xcp2xtp2+sp'."""

from __future__ import annotations

import re
from typing import Any

AXIS_OF = {"pp": "pp", "dpr": "dp_replicate", "dp": "dp_shard", "cp": "cp", "tp": "tp", "ep": "ep"}
OPTIONS: dict[str, dict[str, Any]] = {
    "sp": dict(sequence_parallel=True),
    "ac_op": dict(ac="op"),
    "ac_full": dict(ac="full"),
    "ac_selective": dict(ac="selective"),
    "zero2": dict(fsdp="SHARD_GRAD_OP"),
    "compile": dict(compile=True),
    "async_tp": dict(async_tp=True),  # `tessera plan` only: tessera's tp collectives are not asynchronous
    "ep_overlap": dict(ep_overlap=True),  # `tessera plan` only: tessera's all-to-alls are not overlapped
    "ep_over_tp": dict(ep_over_tp=True),  # `tessera plan` only: tessera's experts are tp-sharded inside ep
}


def parse_layout(name: str) -> dict[str, Any]:
    """'pp2xdp2xcp2xtp2+sp' -> Config.create keywords (dp is dp_replicate x dp_shard; ep adds no ranks)."""
    degrees, *options = name.strip().split("+")
    out: dict[str, Any] = {}
    dp_shard = dp_replicate = 1
    if degrees != "one":
        for term in degrees.split("x"):
            m = re.fullmatch(r"(pp|dpr|dp|cp|tp|ep)(\d+)", term)
            if m is None:  # an empty term (xx, dp2x) is named by the layout as given, not as ''
                what = f"{term!r} is not" if term else "its degrees are not each"
                raise ValueError(
                    f"layout {name!r}: {what} <axis><degree> with axis pp, dpr, dp, cp, tp or ep, joined by x "
                    f"(e.g. one, dp2xtp2, dpr2xdp2, pp2xdp2xcp2xtp2+sp, dp4xep2)"
                )
            axis, degree = AXIS_OF[m.group(1)], int(m.group(2))
            if degree < 1:  # dp0 read as "one" before: a layout that silently ran on one process
                raise ValueError(
                    f"layout {name!r}: {term} has degree 0; each degree is at least 1 (or leave the axis out)"
                )
            if axis == "dp_shard":
                dp_shard = degree
            elif axis == "dp_replicate":
                dp_replicate = degree
            else:
                out[axis] = degree
    if dp_shard * dp_replicate > 1:
        out["dp"], out["dp_replicate"] = dp_shard * dp_replicate, dp_replicate
    for option in options:
        if option not in OPTIONS:
            raise ValueError(f"layout {name!r}: unknown option +{option}; use {', '.join('+' + o for o in OPTIONS)}")
        out.update(OPTIONS[option])
    return out

"""Hardware profiles as data: what a machine can do (peak dense bf16 and FP8 FLOP/s, HBM capacity and bandwidth,
GPUs per node, NVLink and inter-node bandwidth per GPU, collective latency), each figure with its datasheet
source, read from topology/hardware_profiles.json or a user's own JSON file of the same shape (never code).

A profile holds datasheet peaks. What a training step reaches of them (the large-GEMM share of the peak, the
attention kernels' share, the share of HBM bandwidth a copy and an elementwise mix reach, the share of a link
a ring collective reaches, what torch.compile's fusion leaves of eager elementwise traffic) is the file's
`achieved` section: measured on the lent GPUs where we could, stated assumptions where we could not, held
fixed across every row the planner predicts; a profile may override one with its own source.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from tessera.topology.errors import PlanError

PROFILES_FILE = Path(__file__).with_name("hardware_profiles.json")
DEFAULT_PROFILE = "h100-sxm-80gb"
ATTENTION_BACKENDS = ("cudnn", "flash2")


def _finite(value: Any) -> bool:
    """A finite int or float, not a bool (JSON's true would pass as 1)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True)
class Achieved:
    """Shares of a profile's peaks that a step's kernels reach (the profiles file's `achieved`)."""

    gemm_share: float  # a large bf16 GEMM's share of the dense peak (FP8 GEMMs: of the FP8 peak)
    gemm_half_dim: float  # a GEMM whose smallest dimension is d reaches d / (d + gemm_half_dim) of gemm_share
    attention_share: dict[str, float]  # causal flash attention forward + backward at head dim 128, long seq
    attention_half_seq: float  # the share at seq s: attention_share x s / (s + attention_half_seq)
    attention_half_head_dim: float  # and x d / (d + this) x (128 + this) / 128 at head dim d
    hbm_share: float  # a large copy's share of the HBM bandwidth (weights streamed, the optimizer)
    elementwise_share: float  # a block's elementwise mix (norms, RoPE, SwiGLU, residuals)
    link_share: float  # a ring collective's share of a link's per-direction bandwidth
    compiled_elementwise: float  # what torch.compile's fusion leaves of eager elementwise traffic
    fp8_rowwise_speedup: float  # rowwise-scaled FP8 GEMMs over the bf16 rate
    loss_bytes_per_logit: float  # the GPU cross-entropy's memory traffic per logit
    pcie_share: float  # a pinned host copy's share of PCIe's per-direction bandwidth (--offload)
    host_memory_share: float  # the host AdamW's share of the host's DRAM bandwidth (--offload)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            values = v.values() if isinstance(v, dict) else [v]
            for x in values:
                if not (_finite(x) and x > 0):
                    raise PlanError(f"achieved {f.name}={v!r} must be a positive, finite number")
        shares = ("gemm_share", "hbm_share", "elementwise_share", "link_share", "compiled_elementwise", "pcie_share")
        for name in (*shares, "host_memory_share"):
            if getattr(self, name) > 1:
                raise PlanError(f"achieved {name}={getattr(self, name)!r} is a share of a peak: give one in (0, 1]")
        if any(v > 1 for v in self.attention_share.values()):
            raise PlanError(
                f"achieved attention_share={self.attention_share!r}: each is a share of the peak, in (0, 1]"
            )
        missing = [b for b in ATTENTION_BACKENDS if b not in self.attention_share]
        if missing:
            raise PlanError(f"achieved attention_share lacks {', '.join(missing)}; give a share for each backend")

    def attention(self, backend: str, seq_len: int, head_dim: int) -> float:
        """The share of the bf16 peak causal attention's forward + backward reaches at this shape."""
        h = self.attention_half_head_dim
        return (
            self.attention_share[backend]
            * seq_len
            / (seq_len + self.attention_half_seq)
            * head_dim
            / (head_dim + h)
            * (128 + h)
            / 128
        )


@dataclass(frozen=True)
class HardwareProfile:
    """One machine, as its datasheet states it (per GPU; bandwidths per direction)."""

    name: str
    description: str
    bf16_tflops: float
    fp8_tflops: float | None  # None: no FP8 tensor cores (A100)
    hbm_gb: float
    hbm_gbps: float
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    latency_intra_us: float
    latency_inter_us: float
    sm_count: int
    host_memory_gb: float | None
    achieved: Achieved
    sources: dict[str, str] = field(default_factory=dict)
    pcie_gbps: float | None = None  # host <-> GPU per direction (--offload's copies); None: not stated
    host_memory_gbps: float | None = None  # the host's DRAM bandwidth per node (--offload's host step)

    def __post_init__(self) -> None:
        for name in ("bf16_tflops", "hbm_gb", "hbm_gbps", "intra_node_gbps", "inter_node_gbps"):
            v = getattr(self, name)
            if not (_finite(v) and v > 0):
                raise PlanError(f"hardware profile {self.name!r}: {name}={v!r} must be a positive, finite number")
        for name in ("latency_intra_us", "latency_inter_us"):
            v = getattr(self, name)
            if not (_finite(v) and v >= 0):
                raise PlanError(f"hardware profile {self.name!r}: {name}={v!r} must be a finite number >= 0")
        for name in ("pcie_gbps", "host_memory_gbps", "host_memory_gb"):
            v = getattr(self, name)
            if v is not None and not (_finite(v) and v > 0):
                raise PlanError(f"hardware profile {self.name!r}: {name}={v!r} must be a positive number or null")
        if self.fp8_tflops is not None and not self.fp8_tflops > 0:
            raise PlanError(f"hardware profile {self.name!r}: fp8_tflops={self.fp8_tflops!r} must be positive or null")
        for name in ("gpus_per_node", "sm_count"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"hardware profile {self.name!r}: {name}={v!r} must be a positive integer")

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["achieved"] = {f.name: getattr(self.achieved, f.name) for f in fields(self.achieved)}
        return out


_NUMBERS = (
    "bf16_tflops",
    "fp8_tflops",
    "hbm_gb",
    "hbm_gbps",
    "gpus_per_node",
    "intra_node_gbps",
    "inter_node_gbps",
    "latency_intra_us",
    "latency_inter_us",
    "sm_count",
    "host_memory_gb",
)
_OPTIONAL = ("pcie_gbps", "host_memory_gbps")  # null where a file leaves them out (profiles before --offload)


def _read(path: Path, what: str) -> dict[str, Any]:
    if path.exists() and not path.is_file():  # a device (/dev/zero) or a FIFO would be read without end
        raise PlanError(f"{what}{path} is not a regular file; name a hardware profile file (JSON)")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise PlanError(f"{what}{path} cannot be read ({e.strerror}); name a hardware profile file (JSON)") from None
    except UnicodeDecodeError:
        raise PlanError(f"{what}{path} is not UTF-8 text; name a hardware profile file (JSON)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{what}{path} is not JSON ({e.msg} at line {e.lineno}); fix it or name another") from None
    if not isinstance(data, dict) or not isinstance(data.get("profiles"), dict) or not data["profiles"]:
        raise PlanError(f"{what}{path} holds no `profiles` object; write one as topology/hardware_profiles.json does")
    return data


def _builtin() -> dict[str, Any]:
    return _read(PROFILES_FILE, "the built-in profiles file")


def profile_names() -> list[str]:
    """The built-in profiles' names."""
    return sorted(_builtin()["profiles"])


def _resolve(name: str, profiles: dict[str, Any], achieved: dict[str, Any], where: str) -> HardwareProfile:
    chain: list[dict[str, Any]] = []
    at, seen = name, set()
    while True:
        entry = profiles.get(at)
        if not isinstance(entry, dict):
            raise PlanError(f"{where}: profile {name!r} names base {at!r}, which is not a profile there")
        chain.append(entry)
        seen.add(at)
        base = entry.get("base")
        if base is None:
            break
        if base in seen:
            raise PlanError(f"{where}: profile {name!r} has a circular base ({base!r})")
        at = base
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    own_achieved: dict[str, Any] = {}
    for entry in reversed(chain):  # the base first, each child overriding it
        merged.update({k: v for k, v in entry.items() if k in _NUMBERS + _OPTIONAL or k == "description"})
        sources.update(entry.get("sources") or {})
        own_achieved.update(entry.get("achieved") or {})
    missing = [k for k in _NUMBERS if k not in merged]
    if missing:
        raise PlanError(f"{where}: profile {name!r} lacks {', '.join(missing)}; give each (null where unknown)")
    shares = {**achieved, **own_achieved}
    try:
        ach = Achieved(**{f.name: shares[f.name] for f in fields(Achieved)})
    except KeyError as e:
        raise PlanError(f"{where}: the achieved shares lack {e.args[0]!r}; copy them from the built-in file") from None
    figures: dict[str, Any] = {k: merged[k] for k in _NUMBERS} | {k: merged.get(k) for k in _OPTIONAL}
    return HardwareProfile(
        name=name,
        description=str(merged.get("description", name)),
        achieved=ach,
        sources={str(k): str(v) for k, v in sources.items()},
        **figures,
    )


def load_profile(name_or_file: str) -> HardwareProfile:
    """A built-in profile by name (`profile_names`), or the one profile of a user's JSON file (the built-in
    file's shape: `profiles` with one entry, optionally `achieved`; a profile may take a built-in one as its
    `base`). PlanError naming the known profiles for an unknown name."""
    builtin = _builtin()
    if name_or_file in builtin["profiles"]:
        return _resolve(name_or_file, builtin["profiles"], builtin["achieved"], "the built-in profiles")
    path = Path(name_or_file)
    if path.is_dir():
        raise PlanError(f"hardware={path} is a directory; name a hardware profile file (JSON)")
    if path.suffix.lower() != ".json" and not path.is_file():
        raise PlanError(
            f"hardware={name_or_file!r} is not a profile: use one of {', '.join(sorted(builtin['profiles']))} "
            f"or a JSON file of the shape of topology/hardware_profiles.json"
        )
    data = _read(path, "hardware=")
    profiles = {**builtin["profiles"], **data["profiles"]}  # a user's profile may take a built-in one as its base
    own = list(data["profiles"])
    if len(own) != 1:
        raise PlanError(f"hardware={path} holds {len(own)} profiles ({', '.join(own)}); keep one in the file")
    return _resolve(own[0], profiles, {**builtin["achieved"], **(data.get("achieved") or {})}, str(path))


def with_overrides(profile: HardwareProfile, **figures: Any) -> HardwareProfile:
    """The profile with some figures replaced (the loose flags: --peak-tflops, --intra-node-gbps, ...), None
    values left as they are; the replaced figures' sources say so."""
    given = {k: v for k, v in figures.items() if v is not None}
    sources = {**profile.sources, **{k: "given on the command line" for k in given}}
    return replace(profile, sources=sources, **given)


def with_calibration(profile: HardwareProfile, entry: dict[str, Any]) -> HardwareProfile:
    """The profile with its achieved shares taken from a GPU's calibration entry (`tessera plan --calibrate`
    on that GPU: its rates measured at a model's shapes in bf16): the matmul rate over the bf16 peak (as the
    share of a GEMM whose smallest dimension is the measured model's dim), attention's over the peak at the
    measured sequence and head dim, the elementwise mix's and the copy's over the HBM bandwidth. PlanError
    for a CPU's or an fp32 calibration, whose rates say nothing of a GPU's share of its peak."""
    kind = entry.get("device_kind", "?")
    if entry.get("device_type") != "cuda" or entry.get("dtype") != "bfloat16":
        raise PlanError(
            f"calibration {kind!r} ({entry.get('device_type')}, {entry.get('dtype')}) is not a GPU's in bf16; "
            f"overlay a calibration that tessera plan --calibrate measured on a GPU"
        )
    try:
        at = entry["measured_at"]
        dim, seq, head_dim = float(at["dim"]), int(at["seq_len"]), int(at["head_dim"])
        peak, hbm = profile.bf16_tflops * 1e12, profile.hbm_gbps * 1e9
        a = profile.achieved
        # a GEMM of the measured model's shapes reaches gemm_share x d / (d + half): invert at d = dim
        gemm = float(entry["matmul_flops_per_s"]) / peak * (dim + a.gemm_half_dim) / dim
        shape_factor = a.attention("cudnn", seq, head_dim) / a.attention_share["cudnn"]
        attention = float(entry["attention_flops_per_s"]) / peak / shape_factor
        elementwise = float(entry["memory_bytes_per_s"]) / hbm
        copy = float(entry.get("copy_bytes_per_s", entry["memory_bytes_per_s"])) / hbm
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(
            f"calibration {kind!r} lacks a figure ({e}); recalibrate with tessera plan --calibrate"
        ) from None
    achieved = replace(
        a,
        gemm_share=min(1.0, gemm),
        attention_share={**a.attention_share, "cudnn": min(1.0, attention)},
        elementwise_share=min(1.0, elementwise),
        hbm_share=min(1.0, copy),
    )
    where = f"measured on {kind} (tessera plan --calibrate, {entry.get('created', 'undated')})"
    names = ("gemm_share", "attention_share", "elementwise_share", "hbm_share")
    sources = {**profile.sources, **{f"achieved.{k}": where for k in names}}
    return replace(profile, achieved=achieved, sources=sources)

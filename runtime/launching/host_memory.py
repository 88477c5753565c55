"""What this machine's memory allows, read from the kernel: the memory a new run may take (the smaller of
MemAvailable and the cgroup's limit less its usage) and how many processes the kernel's out-of-memory killer
has ended in this cgroup (a rank that died by SIGKILL while that count rose was one of them, or beside one).

cgroup v2 (memory.max, memory.current, memory.events' oom_kill) and v1 (memory.limit_in_bytes,
memory.usage_in_bytes, memory.oom_control's oom_kill) are both read; a file that is missing or unreadable
counts as no limit (or no count), never as an error.
"""

from __future__ import annotations

from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63
# (limit, usage) files of cgroup v2, then v1
CGROUP_MEMORY = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text) if text.isdigit() else None


def _field(path: Path, name: str) -> int | None:
    """`name VALUE` lines (memory.events, memory.oom_control, /proc/meminfo): VALUE of `name`."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[0] == name and parts[1].isdigit():
            return int(parts[1])
    return None


def available_bytes(root: Path = CGROUP, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The memory a new process group may still take on this host: MemAvailable, capped by the cgroup's
    limit less its usage. None when neither can be read."""
    kib = _field(meminfo, "MemAvailable")
    host = kib * 1024 if kib is not None else None
    for limit_file, usage_file in CGROUP_MEMORY:
        limit, usage = _read_int(root / limit_file), _read_int(root / usage_file)
        if limit is not None and limit < UNLIMITED and usage is not None:
            left = max(0, limit - usage)
            host = left if host is None else min(host, left)
            break
    return host


def total_bytes(root: Path = CGROUP, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The memory this host's processes may hold in all: MemTotal, capped by the cgroup's limit. None when
    neither can be read."""
    kib = _field(meminfo, "MemTotal")
    host = kib * 1024 if kib is not None else None
    for limit_file, _ in CGROUP_MEMORY:
        limit = _read_int(root / limit_file)
        if limit is not None and limit < UNLIMITED:
            host = limit if host is None else min(host, limit)
            break
    return host


def oom_kills(root: Path = CGROUP) -> int | None:
    """Processes the kernel's out-of-memory killer has ended in this cgroup so far (None: unknown here)."""
    for path in (root / "memory.events", root / "memory" / "memory.oom_control"):
        count = _field(path, "oom_kill")
        if count is not None:
            return count
    return None

"""Pipeline schedules as data (tessera.topology.schedule) and the simulator that proves them
(tessera.topology.simulator), pure Python, no torch (the planner simulates them too), re-exported here so
`from tessera.parallel.schedule import ...` keeps working."""

from tessera.topology.schedule import (  # noqa: F401
    DEFAULT_COSTS,
    KINDS,
    SPLIT_BACKWARD,
    Action,
    build_schedule,
    check_schedule,
    dependency,
)
from tessera.topology.simulator import Timeline, bubble_of, fused_backwards, render, simulate, validate  # noqa: F401

__all__ = [
    "DEFAULT_COSTS",
    "KINDS",
    "SPLIT_BACKWARD",
    "Action",
    "Timeline",
    "bubble_of",
    "build_schedule",
    "check_schedule",
    "dependency",
    "fused_backwards",
    "render",
    "simulate",
    "validate",
]

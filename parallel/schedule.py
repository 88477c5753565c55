"""Pipeline schedules as data, and the simulator that proves them: tessera.topology.schedule (pure Python,
no torch; the planner simulates them too), re-exported here so `from tessera.parallel.schedule import ...`
keeps working."""

from tessera.topology.schedule import (  # noqa: F401
    DEFAULT_COSTS,
    KINDS,
    SPLIT_BACKWARD,
    Action,
    Timeline,
    build_schedule,
    check_schedule,
    dependency,
    render,
    simulate,
    validate,
)

__all__ = [
    "DEFAULT_COSTS",
    "KINDS",
    "SPLIT_BACKWARD",
    "Action",
    "Timeline",
    "build_schedule",
    "check_schedule",
    "dependency",
    "render",
    "simulate",
    "validate",
]

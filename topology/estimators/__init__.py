"""What a layout costs before it runs, as plain numbers: the planner's search and ranking, one
layout scored alone, each rank's memory, the step's time from a hardware profile or a calibration, each axis's
traffic, and what FP8, Muon, --offload and activation checkpointing change (no torch)."""

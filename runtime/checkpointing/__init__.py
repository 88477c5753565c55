"""Checkpoints: DCP saves and loads of every layout with their manifest (checkpoint.py), reading a
checkpoint without running code and safetensors files (safe_io.py), and one writer per directory, pinned steps
(locks.py)."""

"""Where `tessera train` runs, and the rank server started before the command imports torch.

Outside torchrun, `tessera train` forks its ranks from a forkserver that imports torch and tessera once
(tessera.parallel.launch). Started here, before the command's own imports, the server's imports (seconds)
run on another core beside the command's instead of after them. This module imports no torch.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import forkserver

# the modules tessera.parallel.launch has its forkserver import (tests/test_public_names.py: the same list)
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "tessera",
    "tessera.parallel",
    "tessera.topology",
    "tessera.models",
    "tessera.kernels",
    "tessera.trainer",
    "torch._dynamo",
]


def under_torchrun() -> bool:
    """This process is a rank torchrun (or another launcher setting its variables) started: it joins the job."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("MASTER_ADDR" in os.environ and "RANK" in os.environ)


def speaks_for_the_job() -> bool:
    """This process prints the job's lines: the launching process outside torchrun, rank 0 under it (every
    torchrun worker runs the command, and only one may say what all of them found)."""
    return int(os.environ.get("RANK", "0")) == 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0


def start_rank_server() -> None:
    """Start the forkserver the local ranks fork from, with its imports, and return at once."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()

"""Where `tessera train` runs, and the rank server started before the command imports torch.

Outside torchrun, `tessera train` forks its ranks from a forkserver that imports torch and tessera once
(tessera.parallel.launch). Started here, before the command's own imports, the server's imports (seconds)
run on another core beside the command's instead of after them. This module imports no torch.

Imported by the forkserver (the last of its preload), it also ends that process at once when its launcher
exits. A normal interpreter shutdown with torch, dynamo and tessera loaded is 1.6 CPU seconds of freeing
modules, and the forkserver holds the launcher's stdout and stderr open all that while, so whoever reads them (a
shell pipe, a test's subprocess.run) waits for it after `tessera train` has exited. The forkserver owns nothing a
shutdown must release (its ranks have their own lifeline to the launcher; the listener's directory is the
launcher's), so its exit skips the shutdown: stdio flushed, then os._exit.

It also freezes the server's objects before each fork (`gc.freeze`, Python's advice for a parent that forks
without exec): a rank inherits the ~300,000 objects of torch's and tessera's imports, and frozen they are out of
its collector's reach, so its full collections walk only what the rank made itself.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import sys
from multiprocessing import forkserver
from types import FrameType

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
    "tessera.training.rank_server",  # last: its quick exit (below) must be the first exit handler to run
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


def _imported_by_a_forkserver() -> bool:
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(0)


def _freeze_before_fork() -> None:
    gc.collect()  # what the imports left as garbage is freed, not frozen; later forks find little to collect
    gc.freeze()


if _imported_by_a_forkserver():
    atexit.register(_exit_now)  # the last handler registered runs first: before torch's, and before teardown
    # before each fork, not here: the tests' forkserver imports modules of its own after this one
    os.register_at_fork(before=_freeze_before_fork)

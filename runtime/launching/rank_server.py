"""Where `tessera train` runs, and the rank server started before the command imports torch.

Outside torchrun, `tessera train` forks its ranks from a forkserver that imports torch and tessera once
(tessera.launching.launch). Started here, before the command's own imports, the server's imports (seconds)
run on another core beside the command's instead of after them. This module imports no torch.

Imported by the forkserver (the first of its preload), it pauses Python's garbage collector while the rest of
the preload imports: torch's, dynamo's and tessera's ~300,000 objects live as long as the server, and collecting
them as they came cost ~0.5 CPU seconds of every server's ~2.5 s start. Before each fork it collects once and
freezes what is left (`gc.freeze`, Python's advice for a parent that forks without exec), and the rank it forks
turns the collector back on: frozen, the inherited objects are out of the rank's collector's reach, so its full
collections walk only what the rank made itself.

It also ends the forkserver without the interpreter's shutdown when its launcher exits. A normal shutdown with
torch, dynamo and tessera loaded is 1.6 CPU seconds of freeing modules, and the forkserver holds the launcher's
stdout and stderr open all that while, so whoever reads them (a shell pipe, a test's subprocess.run) waits for it
after `tessera train` has exited. The forkserver owns nothing a shutdown must release (its ranks have their own
lifeline to the launcher; the listener's directory is the launcher's), so its exit skips the shutdown: stdio
flushed, then os._exit. Once it has forked a rank this is its first exit handler; in a server that never forked
(a launcher refused its config first), the other preloaded modules' handlers run before it (0.1 s here).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing
import os
import sys
from collections.abc import Iterator
from multiprocessing import forkserver
from types import FrameType

# the modules tessera.launching.launch has its forkserver import (tests/test_public_names.py: the same list);
# this one first: the collector is paused for the others (above)
PRELOAD = [
    "tessera.launching.rank_server",
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
# and for a run that compiles (--compile): inductor's compiler, which every rank imported at its first compile (1.65
# CPU seconds a rank, once here instead). Not for every run: a server's start would cost that much more
COMPILE_PRELOAD = ["torch._inductor.compile_fx"]


def under_torchrun() -> bool:
    """This process is a rank torchrun (or another launcher setting its variables) started: it joins the job."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("MASTER_ADDR" in os.environ and "RANK" in os.environ)


def speaks_for_the_job() -> bool:
    """This process prints the job's lines: the launching process outside torchrun, rank 0 under it (every
    torchrun worker runs the command, and only one may say what all of them found)."""
    return int(os.environ.get("RANK", "0")) == 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0


def start_rank_server(compiles: bool = False) -> None:
    """Start the forkserver the local ranks fork from, with its imports (and torch.compile's where the ranks will
    compile), and return at once. A server already running is kept as it is."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD + (COMPILE_PRELOAD if compiles else []))
    forkserver.ensure_running()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's garbage collector off for a command's imports of torch and tessera, as the rank server's are:
    objects that live until exit, whose allocations would trigger collections walking them as they come (0.29
    of a `tessera train` launcher's CPU seconds, 0.12 paused); on again after, as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _imported_by_a_forkserver() -> bool:
    """Imported by the forkserver itself while it preloads, not by a process it forked (whose stack still holds
    forkserver.main, below the child's own `_serve_one`): a rank, a user's forkserver worker."""
    child = vars(forkserver)["_serve_one"].__code__  # private, and not in typeshed's stub: every Python 3 has it
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code is child:
            return False
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(0)


def _before_fork() -> None:
    if os.getpid() != _server_pid:  # a rank inherits the hook: what it forks is none of the server's business
        return
    # the last exit handler registered runs first: registered again after every preloaded module's own
    atexit.unregister(_exit_now)
    atexit.register(_exit_now)
    _pick_vector_isa()
    # the imports' garbage (~175,000 of their ~490,000 objects) freed, not frozen for the ranks' lifetime: 0.2 CPU
    # seconds at the first fork; at later ones it walks only what the server made since
    gc.collect()
    gc.freeze()


def _pick_vector_isa() -> None:
    """In a server that preloaded inductor's compiler (COMPILE_PRELOAD), the CPU's vector instruction sets it
    may generate kernels for, found once here and inherited by every rank (inductor keeps them per process).
    Each rank found them itself at its first C++ kernel: a test library per candidate compiled once per machine,
    then each loaded by a fresh interpreter (six on this AVX-512 CPU: 0.7 CPU seconds a rank, 72 interpreters
    in a run of the tests)."""
    global _vector_isa_picked
    if _vector_isa_picked or COMPILE_PRELOAD[0] not in sys.modules:
        return
    _vector_isa_picked = True
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list  # lazy: imported with COMPILE_PRELOAD, just above

    valid_vec_isa_list()


def _in_a_rank() -> None:
    global _collector_paused_here
    if _collector_paused_here:  # copied from the server; a process a rank forks finds it down
        _collector_paused_here = False
        gc.enable()


_server_pid = -1
_collector_paused_here = False
_vector_isa_picked = False
if _imported_by_a_forkserver():
    _server_pid = os.getpid()
    _collector_paused_here = True
    gc.disable()  # for the preload's imports, and in the server for good: it collects before each fork
    atexit.register(_exit_now)  # before teardown even when no rank is ever forked
    os.register_at_fork(before=_before_fork, after_in_child=_in_a_rank)

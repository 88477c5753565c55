"""The pipeline in a simulated world: pp stages are different programs (MPMD), so LocalTensorMode's one
program over every rank cannot hold them. Here each pp rank runs in a thread of its own, under a
LocalTensorMode over the global ranks of its stage (every rank with its pp coordinate: the same program on
each), and only one thread runs at a time: the one holding the baton, which it hands on only where it waits
for a message or for a collective that spans stages. torch's own LocalRunnerMode does the same per rank.

What crosses stages is handled here, no send happens:
  - the executor's activations and input gradients (parallel/pipeline.py asks `simulated_pipeline()`): a
    LocalTensor over the sender's ranks posted under its key, taken by the receiver as a LocalTensor over its
    own, each rank's value moved to the rank of the same data, tensor and context coordinates;
  - an all-reduce whose groups span stages (the loss and grad norm over pp, the tied embedding's first/last
    stage group): every stage it spans posts its tensor, and the last to arrive reduces each group over its
    members, in group order, as torch's simulated all-reduce does within one world.
Any other collective whose groups span stages is refused by name (StageCrossing), never skipped: torch's
simulated collectives pass over a group whose ranks a world does not hold, which would leave it unreduced."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

_THIS = threading.local()  # .pipeline, .stage: the simulated pipeline this thread runs a stage of


class StageCrossing(RuntimeError):
    """A collective whose groups span pipeline stages, which the simulated pipeline does not run."""


class SimulatedPipeline:
    """The coordinator of one simulated pipeline: `stage_ranks[p]` are the global ranks of pp rank p, aligned
    so that stage_ranks[p][i] and stage_ranks[q][i] hold the same data, tensor and context coordinates.
    `timeout`: seconds a stage may wait while the others run, before it is reported stalled."""

    def __init__(self, stage_ranks: Sequence[Sequence[int]], timeout: float = 600.0):
        self.stage_ranks = [list(r) for r in stage_ranks]
        self.stage_of = {r: p for p, ranks in enumerate(self.stage_ranks) for r in ranks}
        self.timeout = timeout
        self.baton = threading.Condition()
        self.mail: dict[tuple[int, tuple], Any] = {}  # (receiving stage, key) -> the sender's tensor
        self.posts: dict[tuple[frozenset[int], int], dict[int, Any]] = {}  # an all-reduce's contributions
        self.reduced: dict[tuple[frozenset[int], int], int] = {}  # how many stages took a finished one
        self.calls: dict[tuple[int, frozenset[int]], int] = {}  # per stage: all-reduces over each stage set
        self.waiting: dict[int, tuple[str, Callable[[], bool]]] = {}  # stage -> what it waits for, and whether it came
        self.running = len(self.stage_ranks)
        self.failed: BaseException | None = None

    # ------------------------------------------------------------------ running the stages
    def run(self, stage_fn: Callable[[int], Any]) -> list[Any]:
        """stage_fn(p) on a thread per pp rank, one at a time; their results in pp order, or the first
        failure raised (the others woken and stopped)."""
        results: list[Any] = [None] * len(self.stage_ranks)

        def body(p: int) -> None:
            _THIS.pipeline, _THIS.stage = self, p
            with self.baton:
                try:
                    results[p] = stage_fn(p)
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    if self.failed is None:
                        self.failed = e
                finally:
                    self.running -= 1
                    self.baton.notify_all()

        threads = [threading.Thread(target=body, args=(p,), name=f"pp-stage-{p}") for p in range(len(results))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.failed is not None:
            raise self.failed
        return results

    def _wait(self, stage: int, what: str, ready: Callable[[], bool]) -> None:
        """Hand the baton on until `ready()`: a stall is named (which stage, waiting for what) when every stage
        still running waits, or after the timeout."""
        self.waiting[stage] = (what, ready)
        self.baton.notify_all()
        try:
            while not ready():
                if self.failed is not None:
                    raise RuntimeError(f"pp rank {stage} stopped: another stage failed ({self.failed!r})")
                if len(self.waiting) == self.running and not any(came() for _, came in self.waiting.values()):
                    stalls = "; ".join(f"pp rank {p} waits for {w}" for p, (w, _) in sorted(self.waiting.items()))
                    raise RuntimeError(f"the simulated pipeline stalled, every stage waiting: {stalls}")
                if not self.baton.wait(self.timeout) and not ready():
                    raise RuntimeError(f"pp rank {stage} stalled {self.timeout:g} s waiting for {what}")
        finally:
            del self.waiting[stage]

    # ------------------------------------------------------------------ messages
    def post(self, sender: int, receiver: int, key: tuple, tensor: Any) -> None:
        """The sender's LocalTensor `tensor` for `receiver` under `key` (each rank's value copied now)."""
        from .local_world import world_disabled  # lazy: (torch, as below)

        with world_disabled():
            values = {r: t.detach().clone() for r, t in tensor._local_tensors.items()}
        self.mail[(receiver, key)] = (sender, values)
        self.baton.notify_all()

    def take(self, receiver: int, key: tuple) -> Any:
        """The tensor posted for `receiver` under `key`, as a LocalTensor over the receiver's ranks (waits)."""
        # lazy: torch's simulated world, used only inside one
        from torch.distributed._local_tensor import LocalTensor

        from .local_world import world_disabled

        self._wait(
            receiver, f"{key[0]} of microbatch {key[1]} for stage {key[2]}", lambda: (receiver, key) in self.mail
        )
        sender, values = self.mail.pop((receiver, key))
        moved = {self.stage_ranks[receiver][self.stage_ranks[sender].index(r)]: t for r, t in values.items()}
        with world_disabled():
            return LocalTensor(moved)

    # ------------------------------------------------------------------ collectives across stages
    def all_reduce(self, stage: int, tensor: Any, groups: list[list[int]], reduce: Callable[[list], Any]) -> None:
        """An all-reduce of `groups` (global ranks) spanning stages: this stage's LocalTensor posted, and when
        every stage the groups touch has posted, each group reduced over its members (`reduce`, on their
        values in group order) and written back into every member's value."""
        spanned = frozenset(self.stage_of[r] for g in groups for r in g)
        if stage not in spanned:
            return
        n = self.calls.get((stage, spanned), 0)
        self.calls[(stage, spanned)] = n + 1
        key = (spanned, n)
        posts = self.posts.setdefault(key, {})
        posts[stage] = tensor
        if len(posts) == len(spanned):  # the last to arrive reduces for all
            for group in groups:
                values = [posts[self.stage_of[r]]._local_tensors[r] for r in group]
                out = reduce(values)
                for v in values:
                    v.copy_(out)
            self.reduced[key] = 0
            self.baton.notify_all()
        else:
            self._wait(stage, f"an all-reduce over pp ranks {sorted(spanned)}", lambda: key in self.reduced)
        self.reduced[key] += 1
        if self.reduced[key] == len(spanned):
            del self.reduced[key], self.posts[key]


def stage_ranks(layout: Any) -> list[list[int]]:
    """Each pp rank's global ranks, aligned across stages: entry i of every stage is one pipeline's rank
    (layout.group("pp", r) of the i-th rank of the first stage)."""
    pipelines = [layout.group("pp", r) for r in range(layout.world_size) if layout.coords(r)["pp"] == 0]
    return [[pipeline[p] for pipeline in pipelines] for p in range(layout.pp)]


def simulated_pipeline() -> tuple[SimulatedPipeline, int] | None:
    """(the simulated pipeline, this thread's pp rank) where this thread runs a stage of one, else None."""
    pipeline = getattr(_THIS, "pipeline", None)
    return None if pipeline is None else (pipeline, _THIS.stage)


def this_rank(default: Callable[[], int]) -> int:
    """The global rank this code speaks for: `default()` (torch.distributed.get_rank), or in a simulated
    pipeline the first rank of this thread's stage (each of the stage's ranks runs the stage's program)."""
    here = simulated_pipeline()
    return default() if here is None else here[0].stage_ranks[here[1]][0]


@contextlib.contextmanager
def stage_crossing_collectives() -> Iterator[None]:
    """For the block: torch's simulated all-reduce, where its groups span stages, run by the pipeline's
    all_reduce; any other simulated collective whose groups span stages raises StageCrossing."""
    # lazy: torch's simulated collectives, patched only around a simulated pipeline
    import torch.distributed._local_tensor._c10d as c10d

    prepare, all_reduce = c10d._prepare_collective_groups, c10d._local_all_reduce_

    def groups_of(process_group_so: Any) -> list[list[int]]:
        ranks, offsets, _ = prepare(process_group_so)
        return [[o + r for r in ranks] for o in offsets]

    def spans(groups: list[list[int]]) -> list[int] | None:
        here = simulated_pipeline()
        if here is None:
            return None
        pipeline, stage = here
        mine = set(pipeline.stage_ranks[stage])
        return next((g for g in groups if mine & set(g) and not set(g) <= mine), None)

    def guarded_prepare(process_group_so: Any) -> Any:
        out = prepare(process_group_so)
        crossing = spans([[o + r for r in out[0]] for o in out[1]])
        if crossing is not None:
            raise StageCrossing(
                f"a collective over ranks {crossing} spans pipeline stages; the simulated pipeline runs only "
                f"all-reduces across stages (and the executor's messages)"
            )
        return out

    def staged_all_reduce(tensors: list, process_group_so: Any, reduce_op_so: Any, *args: Any, **kw: Any) -> Any:
        groups = groups_of(process_group_so)
        here = simulated_pipeline()
        if here is None or spans(groups) is None:
            return all_reduce(tensors, process_group_so, reduce_op_so, *args, **kw)
        op = reduce_op_so.op()
        here[0].all_reduce(here[1], tensors[0], groups, lambda values: c10d._local_reduce(op, values))
        work = c10d.FakeWork()
        return tensors, c10d.Work.boxed(work)

    c10d._prepare_collective_groups, c10d._local_all_reduce_ = guarded_prepare, staged_all_reduce
    try:
        yield
    finally:
        c10d._prepare_collective_groups, c10d._local_all_reduce_ = prepare, all_reduce


@contextlib.contextmanager
def modes_per_thread() -> Iterator[None]:
    """For the block, a LocalTensorMode per thread: torch's mode stacks kept per thread (as its LocalRunnerMode
    does), and DeviceMesh's rank lookups and the seeding functions, which each mode patches on the class as it
    is enabled and restores as it is disabled, patched once for all threads instead, each call asking the
    calling thread's enabled mode (torch's own methods where it has none). Per-mode patching assumes one
    thread: a stage entering its mode while another's is enabled would save the patched methods as the
    originals, and a stage leaving first would unpatch them under the others."""
    import importlib  # lazy: (as below)

    # lazy: torch's simulated world, patched only around a simulated pipeline
    import torch.distributed._local_tensor as lt
    from torch.distributed.device_mesh import DeviceMesh

    saved_mesh = {name: DeviceMesh.__dict__[name] for name in lt._PATCHED_DEVICE_MESH_METHODS}
    saved_random = {}
    for path, _ in lt._PATCHED_RANDOM_FUNCTIONS:
        module, attr = path.rsplit(".", 1)
        saved_random[path] = getattr(importlib.import_module(module), attr)
    saved_mode = {
        name: lt.LocalTensorMode.__dict__[name]
        for name in (
            "_patch_device_mesh",
            "_unpatch_device_mesh",
            "_patch_random_functions",
            "_unpatch_random_functions",
        )
    }

    def dispatching(name: str) -> Callable[..., Any]:
        original = saved_mesh[name]

        def method(mesh: Any, *args: Any, **kw: Any) -> Any:
            if lt.enabled_local_tensor_mode() is not None:
                return getattr(lt._LocalDeviceMesh, name)(mesh, *args, **kw)
            return original(mesh, *args, **kw)

        return method

    process_mode = lt._PROCESS_MODE
    lt._PROCESS_MODE = False
    for name in saved_mesh:
        setattr(DeviceMesh, name, dispatching(name))
    for path, local in lt._PATCHED_RANDOM_FUNCTIONS:  # each falls back to torch's own without an enabled mode
        module, attr = path.rsplit(".", 1)
        setattr(importlib.import_module(module), attr, getattr(lt._LocalRandom, local))
    for name in saved_mode:
        setattr(lt.LocalTensorMode, name, lambda self: None)
    try:
        yield
    finally:
        lt._PROCESS_MODE = process_mode
        for name, value in saved_mode.items():
            setattr(lt.LocalTensorMode, name, value)
        for name, value in saved_mesh.items():
            setattr(DeviceMesh, name, value)
        for path, value in saved_random.items():
            module, attr = path.rsplit(".", 1)
            setattr(importlib.import_module(module), attr, value)

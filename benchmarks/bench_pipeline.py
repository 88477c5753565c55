"""Pipeline benchmark: tessera's executor against torch.distributed.pipelining, the same kind of
schedule on the same stages, side by side in one run.

For each schedule kind, every pp rank builds its stage(s) twice from the same seed (one copy per
executor), then runs forward + backward over the same microbatches, alternating tessera and torch
step by step so both see the same machine state. Figures per kind:

    step time (median over the timed steps, slowest rank) of each executor, and their ratio: the median
    over steps of torch's step over tessera's step just before it (pairs cancel the machine's drift), with
    the ratio's quartiles over the steps, so a difference can be told from the noise
    the gradient difference between the two executors (they compute the same function)
    peak memory per rank of each executor (CPU: peak RSS of a separate run of each; GPU: max allocated)
    tessera's measured bubble (idle share of the ranks between the first and last action, from the
    executor's trace: a rank is idle only while it waits for a message) beside the simulated bubble of the
    same schedule with each action's measured cost

    python benchmarks/bench_pipeline.py --pp 2 --microbatches 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tessera.models import get_preset  # noqa: E402
from tessera.parallel import materialize  # noqa: E402
from tessera.parallel.loss import CrossEntropySum  # noqa: E402
from tessera.parallel.pipeline import PipelineRunner, build_stage, split_layers, stages_of_rank  # noqa: E402
from tessera.topology.schedules.schedule import build_schedule  # noqa: E402
from tessera.topology.schedules.simulator import simulate  # noqa: E402
from tessera.topology.schedules.schedule import VIRTUAL_KINDS, V_KINDS, Action, placement_of  # noqa: E402
from tessera.topology.schedules.simulator import bubble_of  # noqa: E402

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",  # torch's zero-bubble schedule with one stage per rank
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
MULTI_STAGE = (
    "interleaved-1f1b",
    "zb-h1",
    "looped-bfs",
    "interleaved-zb",
    "zbv",
    "dualpipev",
)  # torch classes taking a stage list


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(dist.get_rank())
        return torch.device("cuda", dist.get_rank())
    return torch.device("cpu")


def _stages(cfg, kind: str, pp: int, virtual: int, device: torch.device) -> dict[int, torch.nn.Module]:
    n_stages = pp * virtual
    layers = split_layers(cfg.n_layers, n_stages)
    out = {}
    for s in stages_of_rank(dist.get_rank(), pp, virtual, placement_of(kind)):
        out[s] = materialize(build_stage(cfg, s, n_stages, layers[s]), device, seed=0)
    return out


def _batches(cfg, rows: int, seq: int, microbatches: int, device: torch.device):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (rows * microbatches, seq + 1), generator=gen).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _tessera(cfg, kind, pp, virtual, microbatches, device):
    stages = _stages(cfg, kind, pp, virtual, device)
    runner = PipelineRunner(
        stages,
        kind,
        dist.group.WORLD,
        microbatches,
        virtual,
        CrossEntropySum(cfg.vocab_size),
        lambda rows, seq: ((rows, seq, cfg.dim), torch.float32),
        device,
    )
    runner.record_trace = True
    return stages, runner


def _no_warmup_to_self(stage) -> None:
    """torch < 2.13 warms up a stage's neighbours with a send and a receive each way before its first step, to
    its own rank where a V schedule (zbv, dualpipev) puts two adjacent stages on one rank; gloo has no pair to
    its own rank and raises "Pair is not connected (... <--> [none])". Those two stages pass activations in
    memory in the steps, so the self-addressed warm-up ops are dropped (torch 2.13 warms up without them)."""
    ops_of = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if ops_of is not None:
        rank = dist.get_rank()
        stage._get_init_p2p_neighbors_ops = lambda: [op for op in ops_of() if op.peer != rank]


def _torch(cfg, kind, pp, virtual, microbatches, device):
    import torch.distributed.pipelining as pipelining

    stages = _stages(cfg, kind, pp, virtual, device)
    n_stages = pp * virtual
    wrapped = [pipelining.PipelineStage(m, s, n_stages, device, group=dist.group.WORLD) for s, m in stages.items()]
    if dist.get_backend() == "gloo":
        for stage in wrapped:
            _no_warmup_to_self(stage)

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    cls = getattr(pipelining, TORCH_SCHEDULES[kind])
    multi = kind in MULTI_STAGE
    schedule = cls(wrapped if multi else wrapped[0], microbatches, loss_fn=loss_fn)
    return stages, schedule


def _run_tessera(runner, inputs, targets, microbatches):
    mbs = list(zip(inputs.chunk(microbatches), targets.chunk(microbatches)))
    runner.forward_backward(mbs, targets.numel())


def _run_torch(schedule, inputs, targets, first: bool, last: bool):
    args = (inputs,) if first else ()
    schedule.step(*args, target=targets if last else None)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _grads(stages):
    return {n: p.grad.detach().clone() for m in stages.values() for n, p in m.named_parameters() if p.grad is not None}


def _zero(stages):
    for m in stages.values():
        m.zero_grad(set_to_none=True)


def side_by_side(
    model: str,
    n_layers: int,
    kind: str,
    pp: int,
    virtual: int,
    microbatches: int,
    rows: int,
    seq: int,
    steps: int,
    warmup: int,
):
    """On every rank: step times of both executors (alternating), gradient difference, tessera's trace."""
    device = _device()
    cfg = get_preset(model, n_layers=n_layers)
    n_stages = pp * virtual
    mine = stages_of_rank(dist.get_rank(), pp, virtual, placement_of(kind))
    first, last = 0 in mine, n_stages - 1 in mine
    inputs, targets = _batches(cfg, rows, seq, microbatches, device)
    t_stages, runner = _tessera(cfg, kind, pp, virtual, microbatches, device)
    p_stages, schedule = _torch(cfg, kind, pp, virtual, microbatches, device)
    times = {"tessera": [], "torch": []}
    grad_diff = None
    for step in range(warmup + steps):
        for name in ("tessera", "torch"):
            stages = t_stages if name == "tessera" else p_stages
            _zero(stages)
            dist.barrier()
            started = time.perf_counter()
            if name == "tessera":
                _run_tessera(runner, inputs, targets, microbatches)
            else:
                _run_torch(schedule, inputs, targets, first, last)
            _sync(device)
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank does
            if step >= warmup:
                times[name].append(elapsed.item())
        if step == 0:  # the same function: compare the gradients once
            a, b = _grads(t_stages), _grads(p_stages)
            diff = max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in a)
            grad_diff = torch.tensor([diff], dtype=torch.float64)
            dist.all_reduce(grad_diff, op=dist.ReduceOp.MAX)
    trace = [(start, end, tuple(a)) for start, end, a in runner.trace]  # the last tessera step
    return {"times": times, "grad_max_rel_diff": grad_diff.item(), "trace": trace}


def peak_memory(
    executor: str,
    model: str,
    n_layers: int,
    kind: str,
    pp: int,
    virtual: int,
    microbatches: int,
    rows: int,
    seq: int,
    steps: int,
) -> int:
    """Peak memory of one executor alone (a fresh process per rank: peak RSS on CPU)."""
    import resource

    device = _device()
    cfg = get_preset(model, n_layers=n_layers)
    n_stages = pp * virtual
    mine = stages_of_rank(dist.get_rank(), pp, virtual, placement_of(kind))
    inputs, targets = _batches(cfg, rows, seq, microbatches, device)
    build = _tessera if executor == "tessera" else _torch
    stages, runner = build(cfg, kind, pp, virtual, microbatches, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        _zero(stages)
        if executor == "tessera":
            _run_tessera(runner, inputs, targets, microbatches)
        else:
            _run_torch(runner, inputs, targets, 0 in mine, n_stages - 1 in mine)
    _sync(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def measured_bubble(traces: list[list]) -> tuple[float, dict[str, float]]:
    """(the run's bubble from the executor's trace, as the simulator counts it; mean cost of each op)."""
    costs: dict[str, list[float]] = {}
    for t in traces:
        for s, e, a in t:
            costs.setdefault(a[0], []).append(e - s)
    return bubble_of(traces), {op: statistics.mean(v) for op, v in costs.items()}


def main(argv=None) -> int:
    from tessera.launching.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument(
        "--virtual",
        type=int,
        default=2,
        help="stages per rank for interleaved-1f1b, looped-bfs and interleaved-zb (zbv, dualpipev: always 2)",
    )
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=2, help="sequences per microbatch")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kinds", default=",".join(TORCH_SCHEDULES))
    p.add_argument("--backend", default=None, help="gloo (CPU ranks) or nccl (one GPU per rank); default by machine")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.device_count() >= args.pp else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < args.pp:
        raise SystemExit(f"--pp {args.pp} over NCCL needs {args.pp} GPUs; this machine has {torch.cuda.device_count()}")
    rows = []
    for kind in args.kinds.split(","):
        virtual = 2 if kind in V_KINDS else args.virtual if kind in VIRTUAL_KINDS else 1
        common = (args.model, args.n_layers, kind, args.pp, virtual, args.microbatches, args.rows, args.seq_len)
        results = run_ranks(side_by_side, args.pp, *common, args.steps, args.warmup, timeout=1200, backend=backend)
        memory = {
            ex: run_ranks(peak_memory, args.pp, ex, *common, 2, timeout=1200, backend=backend)
            for ex in ("tessera", "torch")
        }
        times = results[0]["times"]
        t_tessera, t_torch = statistics.median(times["tessera"]), statistics.median(times["torch"])
        paired = [b / a for a, b in zip(times["tessera"], times["torch"])]
        quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
        bubble, costs = measured_bubble([r["trace"] for r in results])
        simulated = simulate(  # each action at its measured cost (a W run with its B: none)
            build_schedule(kind, args.pp, args.microbatches, virtual),
            {"F": 0.0, "B": 0.0, "W": 0.0},
            durations={Action(*a): e - s for r in results for s, e, a in r["trace"]},
        ).bubble
        row = dict(
            kind=kind,
            virtual=virtual,
            torch_schedule=TORCH_SCHEDULES[kind],
            tessera_step_s=t_tessera,
            torch_step_s=t_torch,
            torch_over_tessera=statistics.median(paired),
            torch_over_tessera_quartiles=[quartiles[0], quartiles[2]],
            torch_over_tessera_of_medians=t_torch / t_tessera,
            tessera_peak_memory_bytes=max(memory["tessera"]),
            torch_peak_memory_bytes=max(memory["torch"]),
            measured_bubble=bubble,
            simulated_bubble=simulated,
            mean_op_seconds=costs,
            grad_max_rel_diff=results[0]["grad_max_rel_diff"],
            step_times=times,
        )
        rows.append(row)
        print(
            f"{kind:<17} tessera {t_tessera * 1e3:8.1f} ms  torch {t_torch * 1e3:8.1f} ms  torch/tessera "
            f"{row['torch_over_tessera']:.3f} (quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f})  "
            f"peak {row['tessera_peak_memory_bytes'] / 2**20:,.0f} vs "
            f"{row['torch_peak_memory_bytes'] / 2**20:,.0f} MiB  bubble measured {bubble:.3f} simulated "
            f"{simulated:.3f}  grad diff {row['grad_max_rel_diff']:.1e}",
            flush=True,
        )
    config = dict(vars(args), backend=backend)
    device = "gpu" if backend == "nccl" else "cpu"
    path = write_results(f"pipeline-{args.model}-pp{args.pp}-{device}", config, rows, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

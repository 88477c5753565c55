"""The layout planner: which layout (a degree per axis of topology/axes.py's table: pp, dp_replicate,
dp_shard, cp, tp, and ep for a mixture-of-experts model), FSDP strategy, pipeline schedule and
activation checkpointing to use for a model on N GPUs, before reserving them. The axes it enumerates,
their caps, the axis that takes the ranks left over, the flags of a candidate and which traffic overlaps
compute all come from the table (`layout_degrees`).

For every candidate layout the planner estimates, per rank:

memory  model states (parameters, gradients, optimizer: topology.memory's recipe, counted for the rank
        that holds the most: the first pipeline stage's embedding or the last one's head, the kv
        projections replicated when tp exceeds the kv heads, ceil-division shards as FSDP2 cuts them; an
        MoE block's E / ep experts sharded over the dp_shard x cp / ep ranks ep leaves)
      + the unsharded compute copy FSDP2 gathers (one unit and its prefetch under FULL_SHARD; the whole
        stage under SHARD_GRAD_OP and inside a pipeline step, where parameters stay gathered across
        microbatches) and the unsharded gradients that gradient accumulation keeps until the last one
      + activations: the tensors each block saves for backward (`layer_activation_bytes`), times the
        microbatches in flight on the busiest pipeline rank (from the schedule simulator), reduced by
        activation checkpointing, plus the vocab-parallel loss's logits
      + communication buffers (a unit's reduce-scatter input, ring K/V blocks, pipeline send/receive)
step    model FLOPs (6 N per token, N an MoE model's active parameters, plus causal attention, the formula
        in `model_flops_per_token`; MFU counts the same) and
        recomputation at `efficiency` x `peak_tflops` (or, with a calibration of the device kind, matmuls,
        attention, elementwise memory traffic, the loss, the optimizer and the host's dispatch at the
        measured rates: topology/estimators/step_time.py), stretched by the pipeline bubble from the simulator;
        the experts' grouped GEMMs at their roofline (`expert_weight_seconds`: few tokens per expert make
        them stream weights, not compute); tp, pp and ep (the all-to-alls, balanced routing) traffic
        exposed; FSDP and ring K/V traffic overlapped with compute (only their excess over compute is
        exposed). Each axis's bytes go over the intra-node bandwidth when its group fits inside a node (the
        mesh order puts tp innermost; an ep group is ep consecutive ranks of dp_shard x cp, times tp),
        else over the inter-node bandwidth.

The model is a `ModelShape` (topology/shapes.py: plain numbers a family's spec gives, `spec.shape(config)`;
tessera's LlamaConfig is read by the same field names): its matrices (two or three in the MLP),
head_dim, qk-norm, norms, biases, tied head and position table are what the counts above count. Nothing
here imports torch, tessera.models or tessera.parallel: `tessera plan` resolves a preset name to a shape.

Candidates that do not fit `gpu_memory_gb x (1 - headroom)` are ruled out; the rest are ranked by
estimated step time (then memory). The figures are estimates with stated assumptions; `tessera plan
--dry-run` builds the chosen layout on the fake backend and counts its parameters exactly, and `tessera
bench` puts the predictions beside measurements.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from tessera.topology.axes import (
    TABLE,
    Axis,
    planner_degrees,
    values_of,
)
from tessera.topology.errors import PlanError  # no layout fits, or a request it cannot plan
from tessera.topology.layout import Layout
from tessera.topology.memory import GB, OFFLOAD_MODES, min_gpus

# Defaults, documented in `tessera plan --help`: one H100 SXM (bf16 dense peak), NVLink 4 and 400 Gb/s
from tessera.topology.estimators.plan_inputs import (
    AC_MODES,
    RECOMPUTE,
    STRATEGIES,
    Candidate,
    Estimate,
    Hardware,
    fsdp_degree,
    plural,
)
from tessera.topology.schedules.schedule import SPLIT_BACKWARD, check_schedule
from tessera.topology.shapes import (
    as_shape,
    check_expert_parallel,
    check_tensor_parallel,
)
from tessera.topology.estimators.step_estimate import (
    estimate,
)


# ----------------------------------------------------------------------------- enumeration
def layout_degrees(
    shape, hw: Hardware, seq_len: int, global_batch: int, table: tuple[Axis, ...] = TABLE
) -> list[dict[str, int]]:
    """The degrees the planner tries, one dict per layout (every axis of `table`, in its order), read from
    the table: the axes with a mesh dimension of their own, innermost first (tp, cp, pp), each take the powers
    of two dividing the ranks left within their caps (`planner_degrees`: tp inside a node and at most the
    heads, cp at most 16, pp at most the layers); the other axes the rest axis's flag counts (dp_replicate)
    take powers of two of what they leave, and the rest axis (dp_shard) the remainder; an axis that borrows
    others' dimensions (expert parallel) then takes powers of two dividing their product. Degrees that break
    a rule of the table for this shape, sequence and batch are left out."""
    rest = next(a for a in table if a.planner.rest)
    by_name = {a.name: a for a in table}
    shared = [by_name[n] for n in rest.counts if n != rest.name]
    enumerated = [a for a in reversed(table) if not a.borrows and a.name not in rest.counts]
    steps = enumerated + shared + [rest] + [a for a in table if a.borrows]
    values = values_of(shape, table=table, seq_len=seq_len, global_batch=global_batch)
    out: list[dict[str, int]] = []

    def walk(i: int, left: int, degrees: dict[str, int]) -> None:
        if i == len(steps):
            full = {a.name: degrees[a.name] for a in table}
            if not any(a.problems(full, values) for a in table):
                out.append(full)
            return
        a = steps[i]
        if a is rest:
            walk(i + 1, 1, {**degrees, a.name: left})
            return
        ranks = math.prod(degrees[n] for n in a.borrows) if a.borrows else left
        for d in planner_degrees(a, ranks, shape, hw.gpus_per_node):
            walk(i + 1, left if a.borrows else left // d, {**degrees, a.name: d})

    walk(0, hw.gpus, {})
    return out


def candidates(shape, hw: Hardware, seq_len: int, global_batch: int) -> list[Candidate]:
    """Every layout tessera can run for this request (`runnable`: the checks tessera's ParallelConfig.check
    makes, in plain numbers) over the table's degrees (`layout_degrees`: tp inside a node, powers of two per
    axis), with the FSDP strategies, pipeline schedules, microbatches (1, 2, 4 and 8; or 1, 2 and 4 per
    stage) and activation checkpointing modes."""
    cfg = as_shape(shape)
    return [
        c
        for degrees in layout_degrees(cfg, hw, seq_len, global_batch)
        for c in candidates_of_layout(cfg, Layout(**degrees), seq_len, global_batch)
    ]


def candidates_of_layout(
    shape,
    lay: Layout,
    seq_len: int,
    global_batch: int,
    microbatches: list[int] | None = None,
    schedules: list[tuple[str, int]] | None = None,
) -> list[Candidate]:
    """The runnable settings of one layout: FSDP strategies, schedules, microbatches, checkpointing modes;
    `microbatches` and `schedules` ((kind, virtual) pairs) replace the counts and schedules the planner tries."""
    cfg = as_shape(shape)
    rows = global_batch // lay.dp
    out: list[Candidate] = []
    # inside a pipeline FSDP2 keeps units gathered across microbatches either way: one strategy
    for strategy in STRATEGIES if fsdp_degree(lay) > 1 and lay.pp == 1 else ("FULL_SHARD",):
        for sched, virtual in schedules or _schedules(lay.pp, cfg.n_layers):
            for mb in microbatches or _microbatch_counts(rows, lay.pp):
                for ac in AC_MODES:
                    cand = Candidate(lay, strategy, ac, sched, mb, virtual)
                    if runnable(cfg, cand, seq_len, global_batch):
                        out.append(cand)
    return out


def why_not_runnable(shape, cand: Candidate, seq_len: int, global_batch: int) -> str | None:
    """Why tessera would refuse to run `cand` for a model of `shape` (None: it runs): the checks of
    tessera.parallel's ParallelConfig.check (ring context parallel, the chunked loss) as plain arithmetic,
    so that the planner needs no torch. Context parallel splits the sequence into 2 x cp chunks (whose
    S / cp tokens split over tp under sequence parallel); tp divides the heads and the MLP width, and the kv
    heads divide tp or tp divides them; pp x virtual stages have a block each and the schedule can be built
    (a split-backward schedule runs without checkpointing); dp splits the global batch and the microbatches
    split a dp rank's rows."""
    cfg = as_shape(shape)
    lay, sp = cand.layout, cand.sequence_parallel
    if cand.strategy not in STRATEGIES or cand.ac not in AC_MODES:
        return f"strategy {cand.strategy!r} / ac {cand.ac!r}: the planner knows {STRATEGIES} and {AC_MODES}"
    if lay.cp > 1:
        multiple = math.lcm(2 * lay.cp, lay.cp * lay.tp) if sp and lay.tp > 1 else 2 * lay.cp
        if seq_len % multiple:
            return f"seq_len={seq_len} does not split into {multiple} chunks for cp={lay.cp}"
    try:  # the rules parallelize checks, in their words
        check_tensor_parallel(cfg, lay.tp)
        check_expert_parallel(cfg.n_experts, lay.ep, fsdp_degree(lay), cfg.family)
    except ValueError as e:
        return str(e)
    if lay.ep > 1 and cand.ac == "op":  # the experts' FSDP2 unit inside an op-checkpointed block (parallelize)
        return f"ac=op with ep={lay.ep} is not supported; use ac=full or ac=selective with expert parallel"
    if sp and (seq_len // lay.cp) % lay.tp:
        return f"sequence parallel needs the {seq_len // lay.cp} tokens of a cp rank divisible by tp={lay.tp}"
    if lay.pp > 1:
        try:
            check_schedule(cand.schedule, lay.pp, cand.microbatches, cand.virtual)
        except ValueError as e:
            return str(e)
        if lay.pp * cand.virtual > cfg.n_layers:
            return f"{lay.pp * cand.virtual} pipeline stages but only {cfg.n_layers} layers"
        if cand.schedule in SPLIT_BACKWARD and cand.ac != "none":
            return f"schedule={cand.schedule} with ac={cand.ac} is not supported"
    if global_batch % lay.dp:
        return f"global batch {global_batch} does not split over dp={lay.dp}"
    if (global_batch // lay.dp) % cand.microbatches:
        return f"microbatches={cand.microbatches} does not divide the {global_batch // lay.dp} rows of a dp rank"
    return None


def runnable(shape, cand: Candidate, seq_len: int, global_batch: int) -> bool:
    """Whether tessera runs `cand` for a model of `shape` (`why_not_runnable` says why not)."""
    return why_not_runnable(shape, cand, seq_len, global_batch) is None


def _schedules(pp: int, n_layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1)]
    if n_layers >= 2 * pp:
        out += [("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2), ("looped-bfs", 2)]
    return out


def _microbatch_counts(rows: int, pp: int) -> list[int]:
    wanted = [1, 2, 4, 8] if pp == 1 else [pp, 2 * pp, 4 * pp]
    return [m for m in wanted if m <= rows and rows % m == 0]


@dataclass
class PlanResult:
    ranked: list[Estimate]  # the candidates that fit, best first
    closest: Estimate | None  # when nothing fits: the candidate needing the least memory
    considered: int
    request: dict = field(default_factory=dict)
    why: str = ""
    # an MoE model: the fastest fitting layout with expert parallel and its place in the ranking (1 = best),
    # shown beside the top ones when it is not among them (None: a dense model, or none fits)
    best_ep: tuple[int, Estimate] | None = None


def plan(
    shape,
    hw: Hardware,
    seq_len: int,
    global_batch: int,
    top: int | None = None,
    name: str | None = None,
    offload: str | None = None,
) -> PlanResult:
    """Rank every runnable layout for a model of `shape` (a ModelShape: `tessera plan` resolves a preset name
    with spec_of(config).shape(config)) on `hw`; raise PlanError saying what is short when none fits. `name`
    is what the request and the messages call the model (default: the shape's family). `offload`: every layout
    with its states there; None: without, unless nothing fits without (then the cheapest mode that fits)."""
    if isinstance(shape, str):
        raise TypeError(
            f"plan() takes a ModelShape, not the name {shape!r}: resolve it with tessera.models "
            f"(cfg = get_preset(name); spec_of(cfg).shape(cfg)), or run `tessera plan --model {shape}`"
        )
    cfg = as_shape(shape)
    model = name or cfg.family
    if seq_len < 1 or global_batch < 1:
        raise PlanError(f"seq_len={seq_len} and global_batch={global_batch} must be positive")
    cands = candidates(cfg, hw, seq_len, global_batch)
    request = {
        "model": model,
        "params": cfg.num_params(),
        "matmul_params": cfg.matmul_params(),
        "experts": cfg.n_experts,
        "seq_len": seq_len,
        "global_batch": global_batch,
        "hardware": asdict(hw),
    }
    if not cands:
        raise PlanError(
            f"no layout of {plural(hw.gpus, 'GPU')} runs {model} with seq_len={seq_len} global_batch="
            f"{global_batch}: the global batch must split over dp (try a multiple of {hw.gpus}) and "
            f"tp must divide the {cfg.n_heads} heads"
        )
    if offload is not None:
        cands = [replace(c, offload=offload) for c in cands]
    estimates = [estimate(cfg, c, hw, seq_len, global_batch) for c in cands]
    offloaded = None
    if offload is None and not any(
        x.fits for x in estimates
    ):  # offload only where nothing fits without it: the cheaper mode first
        for mode in OFFLOAD_MODES[1:]:
            tried = [estimate(cfg, replace(c, offload=mode), hw, seq_len, global_batch) for c in cands]
            if any(x.fits for x in tried):
                estimates, offloaded = tried, mode
                break
    fitting = sorted(
        (x for x in estimates if x.fits),
        key=lambda x: (round(x.time["step"], 6), x.memory["total"], x.candidate.layout.cp, x.candidate.layout.pp),
    )
    closest = min(estimates, key=lambda x: x.memory["total"])
    result = PlanResult(fitting, None if fitting else closest, len(cands), request)
    result.why = why_best(result)  # against every fitting layout, not only the ones shown
    if offloaded is not None:
        best = fitting[0]
        cost = best.time["offload_copies"] + best.time["host_optimizer"]
        result.why = (
            f"no layout fits in {hw.gpu_memory_gb:g} GB without offload: offload={offloaded} moves "
            f"{best.memory['host_offload'] / GB:.1f} GB a rank to host memory and costs {cost:.2f} s of the "
            f"{best.time['step']:.2f} s step (host optimizer {best.time['host_optimizer']:.2f} s, exposed copies "
            f"{best.time['offload_copies']:.2f} s); " + result.why
        )
    result.best_ep = next(((i + 1, x) for i, x in enumerate(fitting) if x.candidate.layout.ep > 1), None)
    result.ranked = fitting[:top] if top else fitting
    if not fitting:
        floor = min_gpus(cfg.num_params(), hw.gpu_memory_gb, hw.recipe)
        raise PlanError(
            f"{model} does not fit on {plural(hw.gpus, 'GPU')} of {hw.gpu_memory_gb:g} GB at seq_len={seq_len} "
            f"global_batch={global_batch}: the closest of {len(cands)} layouts ({closest.candidate.describe()}) "
            f"needs {closest.memory['total'] / GB:.1f} GB per rank against {hw.usable_bytes / GB:.1f} GB usable "
            f"({hw.headroom:.0%} headroom), short by {(closest.memory['total'] - hw.usable_bytes) / GB:.1f} GB; "
            f"model states alone need at least {floor} GPUs of {hw.gpu_memory_gb:g} GB (fully sharded), so add "
            f"GPUs or shorten the sequence or batch"
            + (
                f"; with offload=optimizer or offload=params neither fits either (the node's "
                f"{'unknown' if hw.host_memory_gb is None else f'{hw.host_memory_gb:g} GB'} of host memory included)"
                if offload is None
                else f" (with offload={offload})"
            )
        )
    return result


def wins_by(faster: Estimate, slower: Estimate) -> tuple[str, float]:
    """(what `faster` gains most by, seconds per step) against `slower`: the part of the step time that
    differs most (compute, bubble, each exposed accounting name (tp, pp, ep), the overlapped excess), the
    compute named by what differs in it (`_compute_gain`). `gain_text` adds the settings that differ."""
    label, seconds, _ = _gain(faster, slower)
    return label, seconds


def gain_text(faster: Estimate, slower: Estimate) -> str:
    """`wins_by` in words, with the settings that differ: 'a smaller pipeline bubble (0.150 s/step;
    interleaved-1f1b v2 against 1f1b)'."""
    label, seconds, detail = _gain(faster, slower)
    return f"{label} ({seconds:.3f} s/step; {detail})"


def _gain(faster: Estimate, slower: Estimate) -> tuple[str, float, str]:
    """(label, seconds per step, detail: the settings that differ) of what `faster` gains most by."""
    diffs = {k: slower.time[k] - faster.time[k] for k in faster.time if k != "step"}
    key = max(diffs, key=lambda k: diffs[k])
    settings = _setting_differences(faster.candidate, slower.candidate)
    if key == "compute":
        label, detail = _compute_gain(faster, slower)
        return label, diffs[key], f"{detail}{settings}"
    label = {
        "bubble": "a smaller pipeline bubble",
        "tp": "less tensor-parallel traffic",
        "pp": "less pipeline traffic",
        "ep": "less expert-parallel all-to-all traffic",
        "exposed_overlapped_comm": "less data/context traffic left exposed",
        "recompute": "less recomputation",
        "optimizer": "a smaller optimizer step per rank",
        "cp": "less context-parallel traffic left exposed",
        "fsdp": "less data-parallel (FSDP) traffic left exposed",
    }.get(key, f"less {key} traffic")
    return label, diffs[key], settings


def _setting_differences(a: Candidate, b: Candidate) -> str:
    """The settings in which two candidates differ, as their descriptions write them: 'mb 1 against mb 2'."""

    def settings(c: Candidate) -> list[str]:
        schedule = c.schedule + (f" v{c.virtual}" if c.virtual > 1 else "") if c.layout.pp > 1 else "no pipeline"
        fsdp = c.strategy if fsdp_degree(c.layout) > 1 else "no FSDP"
        return [str(c.layout), schedule, fsdp, f"ac {c.ac}", f"mb {c.microbatches}"]

    return ", ".join(f"{x} against {y}" for x, y in zip(settings(a), settings(b)) if x != y) or "the same settings"


# the compute parts of a profile's step (step_model.compute_parts) and what a layout gains by each
PHYSICS_PART_GAINS = {
    "matmul": "less matmul time per rank",
    "attention": "less attention time per rank",
    "elementwise": "less elementwise memory traffic per rank",
    "loss": "a cheaper loss per rank",
    "fp8_casts": "fewer FP8 casts per rank",
    "ring_merges": "fewer context-parallel ring merges per rank",
}


def _compute_gain(faster: Estimate, slower: Estimate) -> tuple[str, str]:
    """(label, the detail before the settings) of what makes `faster`'s compute shorter: less recomputation
    only where its checkpointing recomputes less; with a calibration, the part of the compute (host dispatch,
    memory traffic, matmuls, attention) that differs most; on a profile's physics, its part that differs most
    (PHYSICS_PART_GAINS); else the MoE experts' weight streaming (`expert_weight_seconds`), the rest of the
    compute that settings change."""
    if RECOMPUTE[faster.candidate.ac] < RECOMPUTE[slower.candidate.ac]:
        return "less recomputation", ""
    mine, theirs = faster.compute_parts, slower.compute_parts
    if "host" in mine and "host" in theirs:  # the calibrated model's parts
        parts = {k: theirs[k] - mine[k] for k in ("host", "memory", "matmul", "attention")}
        key = max(parts, key=lambda k: parts[k])
        if parts[key] > 0:
            if key == "host":
                return "fewer operators for the host to dispatch", (
                    f"{mine['operators']:,.0f} against {theirs['operators']:,.0f} per step: "
                )
            return {
                "memory": "less memory traffic per rank",
                "matmul": "fewer matmul FLOPs per rank",
                "attention": "fewer attention FLOPs per rank",
            }[key], ""
    if all(k in mine and k in theirs for k in PHYSICS_PART_GAINS):  # a profile's physics (step_model.py)
        parts = {k: theirs[k] - mine[k] for k in PHYSICS_PART_GAINS}
        key = max(parts, key=lambda k: parts[k])
        if parts[key] > 0:
            return PHYSICS_PART_GAINS[key], ""
    if theirs.get("step", 0.0) - mine.get("step", 0.0) < slower.time["compute"] - faster.time["compute"]:
        return "less expert weight streaming", ""
    return "less compute per rank", ""


def why_best(result: PlanResult) -> str:
    """One sentence: what the top layout gains over the runner-up."""
    if not result.ranked:
        return ""
    best = result.ranked[0]
    if len(result.ranked) == 1:
        return f"{best.candidate.describe()} is the only layout that fits."
    ties = [x for x in result.ranked[1:] if x.time["step"] <= best.time["step"] * 1.001]
    # the ranking is by time alone: a tie may hold less memory than the best, and then is named
    least = min([best, *ties], key=lambda x: x.memory["total"])
    holds = (
        "it holds the least memory of them"
        if least is best
        else f"of them {least.candidate.describe()} holds the least memory, {least.memory['total'] / GB:.1f} GB per "
        f"rank against {best.memory['total'] / GB:.1f}"
    )
    tie_note = f" {len(ties)} more layout(s) tie within 0.1% on time; {holds}." if ties else ""
    other = next((x for x in result.ranked[1:] if x.time["step"] > best.time["step"] * 1.001), None)
    if other is None:
        return f"all {len(result.ranked)} layouts shown tie within 0.1% on time; {holds}."
    return (
        f"it wins by {gain_text(best, other)}: an estimated {best.time['step']:.3f} s/step against "
        f"{other.time['step']:.3f} s for the next layout more than 0.1% slower ({other.candidate.describe()}), at "
        f"{best.memory['total'] / GB:.1f} GB per rank against {other.memory['total'] / GB:.1f} GB.{tie_note}"
    )

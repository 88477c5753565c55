"""A layout proved equal to one process at its real world size, every rank simulated in this one process
(torch's LocalTensorMode; runtime/training/simulated.py runs the Trainer so). The layout's real Trainer trains a
tiny model sized so the layout shards it evenly (the debug model grown where it must be, or the user's preset),
then one process trains it alone, and the two are compared step by step (losses, grad norms, every gradient by
name) at the fp32 contract's 1e-5. `tessera check` is its command line; `prove_layout` its API:

    from tessera.testing import prove_layout
    record = prove_layout("dp32xtp8+sp")  # 256 simulated ranks; LayoutsDiverge names what differs
"""

from __future__ import annotations

import json
import math
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from tessera.topology.memory import GB
from tessera.training.layout_names import parse_layout

RTOL = 1e-5  # the fp32 contract's (tests/test_contract.py)
MOE_MODEL = "qwen3-moe-debug"  # an ep layout's model unless one is named: experts to dispatch
FP8_RECIPES = ("tensorwise", "rowwise")
OPTIMIZERS = ("adamw", "muon")  # tessera train's --optimizer
# the FP8 contract's (tests/test_fp8_contract.py): one process's own FP8 error E is measured on its FP8 runs at
# these microbatch counts (their casts scale all, half or a quarter of the tokens, as dp 1, 2 and 4 ranks do)
REROUNDED = (1, 2, 4)
DEFAULT_SEQ_LEN = 32  # tokens per sequence unless the layout needs more (least_seq_len)
MAX_STEPS = 20  # a proof needs a few steps; AdamW's normalization amplifies reassociation past 1e-5 over tens
# layout options a simulated world does not run (why)
REFUSED_OPTIONS = {
    "compile": "torch.compile is not traced under LocalTensorMode; check the layout without +compile",
    "async_tp": "tessera's tp collectives are not asynchronous (+async_tp is tessera plan's only)",
    "ep_overlap": "tessera's all-to-alls are not overlapped (+ep_overlap is tessera plan's only)",
    "ep_over_tp": "tessera's experts are tp-sharded inside ep (+ep_over_tp is tessera plan's only)",
}


def _model_of(model: str | None, layout: Any, scratch: Path, virtual: int = 1) -> tuple[str, Any]:
    """(the model's name for Config.create, its config): the user's preset, else the debug model (an ep
    layout's: the MoE debug model) sized for the layout's tp and pp x `virtual` stages (and experts for its
    ep), written as a config.json under `scratch` (hf:DIR). Widths the FSDP ranks do not split are simulated
    as FSDP2 shards them: padded, the last shards shorter or empty."""
    from tessera.models import get_preset  # lazy: tessera.models imports torch
    from tessera.models.hf import hf_config_dict
    from tessera.training.simulated import sized_model, sized_moe_model

    if model is None and layout.ep > 1:  # experts to dispatch: the MoE debug model, sized for the layout
        cfg = sized_moe_model(get_preset(MOE_MODEL), layout, virtual)
        (scratch / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
        return f"hf:{scratch}", cfg
    if model is not None and model != "debug":  # the debug model named: sized like the default
        cfg = get_preset(model)  # its ValueError names the presets
        if not hasattr(cfg, "ffn_dim") and not getattr(cfg, "n_experts", None):
            raise ValueError(f"model={model}: a simulated world runs llama-family and MoE models; use the debug model")
        return model, cfg
    cfg = sized_model(get_preset("debug"), layout, virtual)
    (scratch / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    return f"hf:{scratch}", cfg


def least_seq_len(cp: int, tp: int, sequence_parallel: bool, at_least: int = DEFAULT_SEQ_LEN) -> int:
    """The shortest sequence of at least `at_least` tokens a layout splits: 2 x cp zigzag chunks, and under
    sequence parallel each rank's S / cp tokens over tp (parallel/zigzag.py's check_context)."""
    multiple = math.lcm(2 * cp if cp > 1 else 1, cp * tp if sequence_parallel and tp > 1 else 1)
    return -(-at_least // multiple) * multiple


def _prepare(
    layout_name: str,
    world: int | None,
    model: str | None,
    steps: int,
    seq_len: int | None,
    global_batch: int | None,
    scratch: Path,
    fp8: str | None = None,
    pipeline: dict[str, Any] | None = None,
    fsdp: str | None = None,
    optimizer: str = "adamw",
    cp_method: str | None = None,
) -> tuple[dict, dict, int, Any, float]:
    """(one process's Config.create keywords, the layout's, the world, the model's config, the memory estimate):
    every input checked, ValueError naming the parameter and the fix, before anything is built."""
    from tessera.training.run_config import Config  # lazy: torch
    from tessera.training.simulated import (
        available_bytes,
        check_simulated,
        estimate_bytes,
        require_local_tensor,
    )

    options = [o for o in layout_name.split("+")[1:] if o in REFUSED_OPTIONS]
    if options:
        raise ValueError(f"layout={layout_name}: +{options[0]}: {REFUSED_OPTIONS[options[0]]}")
    kw = parse_layout(layout_name)  # its ValueError: "layout 'xx': ..."
    pipeline = {k: v for k, v in (pipeline or {}).items() if v is not None}
    if pipeline and kw.get("pp", 1) == 1:
        named = ", ".join(f"{k}={v}" for k, v in pipeline.items())
        raise ValueError(f"{named} with layout={layout_name}: a pipeline option needs a pp layout (e.g. pp2x...)")
    kw.update(pipeline)
    if fsdp is not None:
        if kw.get("fsdp", fsdp) != fsdp:
            raise ValueError(f"fsdp={fsdp} with layout={layout_name}, whose +zero2 is SHARD_GRAD_OP: name one of them")
        kw["fsdp"] = fsdp
    if cp_method is not None:
        if kw.get("cp", 1) == 1:
            raise ValueError(f"cp_method={cp_method} with layout={layout_name}: it needs a cp layout (e.g. dp2xcp2)")
        kw["cp_method"] = cp_method
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps={steps} must be 1..{MAX_STEPS} (a proof needs a few steps), e.g. steps=2")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if fp8 is not None and fp8 not in FP8_RECIPES:
        raise ValueError(f"fp8={fp8!r} is not an FP8 recipe: use one of {', '.join(FP8_RECIPES)}, or leave it out")
    probing = Config.create(model="debug", quiet=True, **kw)
    probe = probing.layout
    world = probe.world_size if world is None else world
    if world != probe.world_size:
        raise ValueError(
            f"world={world} is not the world of layout={layout_name} ({probe.world_size} ranks): name a layout "
            f"of {world} ranks, or leave the world out"
        )
    require_local_tensor()
    virtual = probing.parallel_config().pipeline.virtual if probe.pp > 1 else 1
    name, cfg = _model_of(model, probe, scratch, virtual)
    default_seq = least_seq_len(probe.cp, probe.tp, bool(probing.parallel_config().sequence_parallel))
    if seq_len is None:
        seq_len = default_seq
    if not 1 <= seq_len <= cfg.max_seq_len:
        raise ValueError(f"seq_len={seq_len} must be 1..{cfg.max_seq_len} (the model's max_seq_len), e.g. 32")
    # 2 rows per data-parallel rank, and with pp a row per microbatch (those named, or the fewest its schedule runs)
    least = 1
    if probe.pp > 1:
        from tessera.topology.schedules.schedule import fewest_microbatches  # lazy: (as above)

        least = fewest_microbatches(probing.parallel_config().pipeline.kind or "1f1b", probe.pp, virtual)
    rows = max(2, pipeline.get("microbatches", least))
    default_batch = rows * probe.dp_replicate * probe.dp_shard
    batch = default_batch if global_batch is None else global_batch
    common = dict(
        model=name,
        seq_len=seq_len,
        global_batch=batch,
        steps=steps,
        lr=3e-3,
        warmup=1,
        device="cpu",
        mixed_precision="fp32",
        quiet=True,
        optimizer=optimizer,
        force=True,  # the host-memory check of real ranks (a runtime each): the simulated world's is below
        **({} if fp8 is None else {"fp8": fp8}),
    )
    config = Config.create(**common, **kw)
    config.check()
    check_simulated(config, world)
    schedule = config.parallel_config().pipeline.schedule  # a kind's name, or rows read from a file
    need = estimate_bytes(cfg, probe, seq_len, batch, config.data.microbatches or 1, schedule, virtual)
    have = available_bytes()
    if need > 0.8 * have:
        # only the fixes that lower the estimate: the proof's defaults are already the least it runs
        fixes = ["the debug model"] if model and model != "debug" else []
        if batch > default_batch:
            fixes.append(f"lower global_batch={batch} (the default here: {default_batch})")
        if seq_len > default_seq:
            fixes.append(f"lower seq_len={seq_len} (the default here: {default_seq})")
        fix = (
            f"use {' or '.join(fixes)}, or a machine with more memory"
            if fixes
            else f"global_batch={batch} and seq_len={seq_len} are the least this layout's proof runs: it needs a "
            f"machine with about {need / 0.8 / GB:.0f} GB free"
        )
        raise ValueError(
            f"layout={layout_name} on {world} simulated ranks needs about {need / GB:.1f} GB here (every rank's "
            f"shards, gathered layers and activations), and this machine has {have / GB:.1f} GB free: {fix}"
        )
    return common, {**common, **kw}, world, cfg, need


def _rss_bytes() -> int:
    """This process's resident memory now (/proc/self/statm; 0 where unreadable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0


def gradient_errors(one: dict, simulated: dict) -> list[float]:
    """Each step's largest gradient error, relative to the model's largest gradient entry (a record: judged
    at step 1 only, see `judge`)."""
    out = []
    for want, got in zip(one["grads"], simulated["grads"]):
        scale = max((g.abs().max().item() for g in want.values() if g.numel()), default=0.0) or 1.0
        err = max(
            ((got[n].double() - g.double()).abs().max().item() for n, g in want.items() if g.numel()), default=0.0
        )
        out.append(err / scale)
    return out


def judge(one: dict, simulated: dict, where: str) -> None:
    """The numerics contract (tests/test_contract.py's): every step's loss and grad norm within RTOL of one
    process's, and every gradient of step 1 (the same weights on both sides) by name. Later steps' gradients
    are not judged entry by entry: AdamW's first update is nearly sign(g), so an entry whose gradient is within
    reassociation of zero moves by +-lr on one side and -+lr on the other; measured on the debug model at dp 64,
    one process against itself at microbatches 2, 4 and 8 (reassociation alone) differs by 1.0-1.5e-5 in
    output.weight's step-2 gradient. The grad norm carries those steps. LayoutsDiverge naming what differs."""
    from .equivalence import LayoutsDiverge, compare_runs  # lazy: (as in prove_layout)

    first_only: list[dict] = [{}] * (len(one["grads"]) - 1)
    compare_runs(
        {**one, "grads": one["grads"][:1] + first_only},
        {**simulated, "grads": simulated["grads"][:1] + first_only},
        where,
        RTOL,
    )
    for step, (want, got) in enumerate(zip(one["grad_norms"], simulated["grad_norms"]), start=1):
        if abs(got - want) > RTOL * abs(want):
            raise LayoutsDiverge(
                f"{where}, step {step}: grad norm {got:.8g} differs from one process's {want:.8g} (relative "
                f"{abs(got - want) / abs(want):.3e} > rtol {RTOL:g})"
            )


def judge_fp8(one: dict, simulated: dict, fp32: dict, rerounded: list[dict], where: str) -> dict[str, float]:
    """The FP8 contract (tests/test_fp8_contract.py's): an FP8 run is the fp32 trajectory plus FP8 rounding, and
    a layout rounds the same quantities elsewhere (each rank's tokens scaled as their own batch), so it is held
    within 2 E of one-process FP8, E the largest distance to fp32 of one process's FP8 runs that differ only by
    where they round (`rerounded`): every step's loss and grad norm, and step 1's gradients tensor by tensor
    (||g - g_fp8|| <= 2 max ||g_fp8' - g_fp32||); every step's matmuls recorded in FP8. The E of the loss and
    grad norm, or LayoutsDiverge naming what differs."""
    from .equivalence import LayoutsDiverge  # lazy: (as in prove_layout)

    ran = set(simulated["compute_dtypes"])
    if not ran <= {"float8", "float8_emulated"} and not any("float8" in k for k in simulated["flops_by_dtype"]):
        raise LayoutsDiverge(f"{where}: the records say the matmuls ran in {sorted(ran)}, not FP8")
    errors = {}
    for what, key in (("loss", "losses"), ("grad norm", "grad_norms")):
        tol = 2 * max(abs(a - b) for r in rerounded for a, b in zip(r[key], fp32[key]))
        errors[what] = tol / 2
        for step, (got, want) in enumerate(zip(simulated[key], one[key]), start=1):
            if abs(got - want) > tol:
                raise LayoutsDiverge(
                    f"{where}, step {step}: {what} {got:.8g} differs from one-process FP8's {want:.8g} by "
                    f"{abs(got - want):.3e} > 2 E = {tol:.3e} (E: one process's own FP8 error)"
                )
    for name, want in one["grads"][0].items():
        tol = 2 * max(float((r["grads"][0][name] - fp32["grads"][0][name]).norm()) for r in rerounded)
        err = float((simulated["grads"][0][name] - want).norm())
        if err > tol:
            raise LayoutsDiverge(
                f"{where}, step 1: gradient of parameter {name!r} differs from one-process FP8: ||g - g_fp8|| "
                f"{err:.3e} > 2 E = {tol:.3e} (E: one process's own FP8 error in it)"
            )
    return errors


def prove_layout(
    layout: str,
    world: int | None = None,
    model: str | None = None,
    steps: int = 2,
    seq_len: int | None = None,
    global_batch: int | None = None,
    fp8: str | None = None,
    schedule: str | None = None,
    virtual: int | None = None,
    microbatches: int | None = None,
    fsdp: str | None = None,
    optimizer: str = "adamw",
    cp_method: str | None = None,
) -> dict[str, Any]:
    """Train `layout` (a tessera bench name, e.g. "dp32xtp8+sp") on its `world` simulated ranks and one process
    alone, and compare them at 1e-5: the record (losses, grad norms, the model's shape, the simulated run's
    seconds, the process's peak memory beside the estimate it was admitted by, a verdict line), or
    LayoutsDiverge naming the first step and parameter that differ. ValueError, before anything is built, for a
    layout or world it cannot simulate (naming why and the fix). Needs a process with no process group.
    `fp8` ("tensorwise" or "rowwise", torchao's float8 emulated on the CPU): both sides train in FP8 and the
    layout is held to the FP8 contract (judge_fp8) against one-process FP8 runs on 1, 2 and 4 microbatches
    and one in fp32. `schedule`, `virtual`, `microbatches`: a pp layout's pipeline (tessera train's
    options; by default 1f1b over the fewest microbatches it needs); one process trains the same
    microbatches' rows in one pass. `fsdp`: the data axis's FSDP2 strategy (FULL_SHARD by default,
    SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD, as tessera train's --fsdp). `optimizer`: "adamw" or "muon"
    (tessera train's --optimizer: Muon on the hidden matrices, each orthogonalized whole by its owner, whose
    gather every simulated rank receives as an all-gather and whose scatter each rank reads its part of).
    `cp_method`: a cp layout's attention, "ring" (the default) or "allgather" (tessera train's --cp-method)."""
    from tessera.training.run_config import Config  # lazy: (as in _prepare)
    from tessera.training.simulated import trace, uneven_shards

    from .equivalence import LayoutsDiverge

    with tempfile.TemporaryDirectory(prefix="tessera-check-") as scratch:
        pipeline = {"schedule": schedule, "virtual": virtual, "microbatches": microbatches}
        one_kw, layout_kw, world, cfg, estimate = _prepare(
            layout, world, model, steps, seq_len, global_batch, Path(scratch), fp8, pipeline, fsdp, optimizer, cp_method
        )
        before = _rss_bytes()
        started = time.perf_counter()
        layout_config = Config.create(**layout_kw)
        ran = layout_config.parallel_config().pipeline if world > 1 and layout_config.layout.pp > 1 else None
        simulated = trace(layout_config, world)
        simulated_s = time.perf_counter() - started
        one = trace(Config.create(**one_kw), 1)
        if fp8 is not None:  # E: one process's FP8 runs at other microbatch counts, against its fp32 run
            fp32 = trace(Config.create(**{k: v for k, v in one_kw.items() if k != "fp8"}), 1)
            batch = one_kw["global_batch"]
            rerounded = [one] + [
                trace(Config.create(**one_kw, microbatches=mb), 1) for mb in REROUNDED[1:] if batch % mb == 0
            ]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    experts = getattr(cfg, "n_experts", 0)
    ffn = f"{experts} experts (top {cfg.top_k}) of ffn {cfg.moe_ffn_dim}" if experts else f"ffn {cfg.ffn_dim}"
    shape = f"dim {cfg.dim}, {cfg.n_heads} heads ({cfg.n_kv_heads} kv), {ffn}, vocab {cfg.vocab_size}"
    norm_error = max(abs(a - b) / abs(b) for a, b in zip(simulated["grad_norms"], one["grad_norms"]))
    record: dict[str, Any] = {
        "layout": layout,
        "world": world,
        "steps": steps,
        "optimizer": optimizer,
        "cp_method": layout_config.parallel_config().cp_method if layout_config.layout.cp > 1 else None,
        "seq_len": one_kw["seq_len"],
        "global_batch": one_kw["global_batch"],
        "model": "debug, sized for the layout" if model in (None, "debug") else model,
        "shape": {
            k: getattr(cfg, k)
            for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "n_experts", "moe_ffn_dim", "vocab_size")
            if hasattr(cfg, k)
        },
        # the tensors FSDP2 shards unevenly on this layout (padded, the last shards shorter or empty): proved too
        "uneven_shards": uneven_shards(cfg, layout_config.layout),
        # a pp layout's pipeline as it ran (its schedule, virtual stages per rank, microbatches)
        "pipeline": None
        if ran is None
        else {"schedule": ran.kind, "virtual": ran.virtual, "microbatches": ran.microbatches},
        "losses": simulated["losses"],
        "one_process_losses": one["losses"],
        "grad_norms": simulated["grad_norms"],
        "one_process_grad_norms": one["grad_norms"],
        "max_relative_grad_norm_error": norm_error,
        "simulated_seconds": round(simulated_s, 2),
        "simulated_build_seconds": round(simulated["build_s"], 2),  # the Trainer: mesh, init, FSDP2 and tp
        "simulated_step_seconds": round(simulated["steps_s"], 2),
        "rss_before_bytes": before,
        "peak_rss_bytes": peak,
        "estimated_bytes": round(estimate),
    }
    record["gradient_error_by_step"] = gradient_errors(one, simulated)
    record["compute_dtypes"] = simulated["compute_dtypes"]  # what the records' dtype probe read, step by step
    where = f"{layout} on {world} simulated ranks" + ("" if fp8 is None else f" in FP8 ({fp8})")
    where += " with Muon" if optimizer == "muon" else ""
    try:
        if fp8 is None:
            judge(one, simulated, where)
        else:
            record["fp8_error"] = judge_fp8(one, simulated, fp32, rerounded, where)
    except LayoutsDiverge as e:
        e.record = {**record, "verdict": f"differs from one process: {e}"}  # type: ignore[attr-defined]
        raise
    within = (
        f"within {RTOL:g} (grad norm off by at most {norm_error:.1e})"
        if fp8 is None
        else f"within 2 E of one-process FP8, E its own FP8 error on {len(rerounded)} microbatch counts against fp32 "
        f"(loss E {record['fp8_error']['loss']:.1e}, grad norm E {record['fp8_error']['grad norm']:.1e}); matmuls "
        f"recorded {'/'.join(sorted(set(simulated['compute_dtypes'])))}"
    )
    uneven = f" (FSDP2's uneven shards of {len(record['uneven_shards'])} tensor shapes among them)" * bool(
        record["uneven_shards"]
    )
    record["verdict"] = (
        f"equal to one process: {where}, {steps} steps of {shape}, seq {one_kw['seq_len']}: every step's loss and "
        f"grad norm and all {len(one['grads'][0])} gradients of step 1{uneven} {within}; {simulated_s:.1f} s, peak "
        f"memory {peak / GB:.2f} GB"
    )
    return record

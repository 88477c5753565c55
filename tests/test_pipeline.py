"""Pipeline parallel beyond the contract table (tests/test_contract.py): bitwise equality with the
one-process run, stage-only memory, checkpoints across pp degrees, the CLI, the memory dry run, and
stage splitting."""

import json

import pytest
import torch

from conftest import PIPELINE_BASE
from helpers import cli_here, script_here, small_config, train_losses_and_grads
from tessera.launching.launch import run_ranks
from tessera.parallel.pipeline import build_stage, split_layers, stages_of_rank
from tessera.training.run import train

NO_CLIP = dict(PIPELINE_BASE, microbatches=4, max_grad_norm=float("inf"))


@pytest.fixture(scope="module")
def unclipped_reference():
    return run_ranks(train_losses_and_grads, 1, small_config(**NO_CLIP), timeout=120)[0]


@pytest.mark.parametrize(
    "layout",
    [
        dict(pp=2),
        dict(pp=4),
        dict(pp=2, schedule="gpipe"),
        dict(pp=4, schedule="zb-h1"),
        dict(pp=2, schedule="interleaved-1f1b", virtual=2),
    ],
    ids=["pp2-1f1b", "pp4-1f1b", "pp2-gpipe", "pp4-zb-h1", "pp2-interleaved-v2"],
)
def test_pipeline_is_bitwise_the_one_process_run_with_the_same_microbatches(unclipped_reference, layout):
    # Every stage runs the one-process ops on the same shapes, and each parameter accumulates its
    # microbatches' gradients in ascending order on every kind (W too), so without clipping (whose norm
    # sums stages in another order) nothing is reassociated: losses and gradients are bitwise equal.
    config = small_config(**NO_CLIP, **layout)
    losses, _, grads = run_ranks(train_losses_and_grads, config.layout.world_size, config, timeout=180)[0]
    ref_losses, _, ref_grads = unclipped_reference
    assert losses == ref_losses
    assert all(torch.equal(grads[name], ref_grads[name]) for name in ref_grads)


def _stage_model_state_bytes(config):
    """(this rank's stages, bytes of parameters + gradients + AdamW state it holds after one step)."""
    from tessera.parallel.fsdp import model_state_bytes_on_rank
    from tessera.trainer import Trainer

    trainer = Trainer(config, torch.device("cpu"))
    trainer.train_step()
    for part in trainer.parts:  # the step freed the gradients; give each its shape back to count them
        for p in part.parameters():
            p.grad = torch.zeros_like(p)
    held = sum(
        model_state_bytes_on_rank(part, opt)["total"] for part, opt in zip(trainer.parts, trainer.optimizer.optimizers)
    )
    names = sorted(n for part in trainer.parts for n, _ in part.named_parameters())
    return list(trainer.runner.stages), held, names


@pytest.mark.parametrize(
    "layout",
    [dict(pp=2, pp_layers="5,3"), dict(pp=4), dict(pp=2, schedule="interleaved-1f1b", virtual=2)],
    ids=["pp2-5,3", "pp4", "pp2-v2"],
)
def test_a_pipeline_rank_holds_only_its_stages(layout):
    from tessera.models import build_model

    config = small_config(**PIPELINE_BASE, microbatches=4, **layout)
    whole = build_model(config.model_config, device="meta")
    params = dict(whole.named_parameters())
    p, v = config.layout.pp, config.parallel.virtual
    layers = split_layers(8, p * v, config.parallel.layers_per_stage)
    seen = set()
    for rank, (stages, held, names) in enumerate(run_ranks(_stage_model_state_bytes, p, config, timeout=120)):
        assert list(stages) == stages_of_rank(rank, p, v)
        expected = set()
        for s in stages:
            expected |= {n for n in params if n.startswith("layers.") and int(n.split(".")[1]) in layers[s]}
            expected |= {n for n in params if s == 0 and n.startswith("tok_embeddings")}
            expected |= {n for n in params if s == p * v - 1 and n.startswith(("norm", "output"))}
        assert sorted(names) == sorted(expected)  # one-process names, only this rank's stages
        assert held == 16 * sum(params[n].numel() for n in expected)  # fp32 params + grads + 2 Adam moments
        seen |= expected
    assert seen == set(params)


@pytest.fixture(scope="module")
def saved_on_pp2xtp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-ckpt")
    history = train(
        small_config(**PIPELINE_BASE, pp=2, tp=2, microbatches=2, steps=6, checkpoint_dir=str(root), checkpoint_every=3)
    )
    return root / "step_00000003", [(m["loss"], m["grad_norm"]) for m in history]


@pytest.mark.parametrize(
    "layout",
    [dict(dp=2, tp=2), dict(pp=4, microbatches=4), dict(pp=2, schedule="interleaved-1f1b", virtual=2, microbatches=2)],
    ids=["dp2xtp2", "pp4", "pp2-interleaved-v2"],
)
def test_a_checkpoint_saved_on_pp2xtp2_resumes_on_other_pp_degrees(saved_on_pp2xtp2, layout):
    path, history = saved_on_pp2xtp2
    resumed = train(small_config(**{**PIPELINE_BASE, "steps": 6, "resume": str(path), **layout}))
    assert [m["step"] for m in resumed] == [4, 5, 6]
    for m, (loss, norm) in zip(resumed, history[3:]):
        assert abs(m["loss"] - loss) <= 1e-5 * abs(loss) and abs(m["grad_norm"] - norm) <= 1e-5 * abs(norm)


def test_cli_trains_a_pipeline_and_reports_the_true_loss(tmp_path, deep_reference):
    metrics = tmp_path / "run.jsonl"
    args = [
        "--model",
        "debug",
        "--n-layers",
        "8",
        "--pp",
        "2",
        "--schedule",
        "interleaved-1f1b",
        "--virtual",
        "2",
        "--microbatches",
        "2",
        "--steps",
        "3",
        "--seq-len",
        "32",
        "--global-batch",
        "8",
        "--lr",
        "3e-3",
        "--warmup",
        "1",
        "--metrics",
        str(metrics),
        "--device",
        "cpu",
    ]
    out = cli_here("train", *args)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
    losses = [r["loss"] for r in records]
    for got, want in zip(losses, deep_reference[0], strict=True):
        assert abs(got - want) <= 1e-5 * want  # the global loss, shared from the last stage
    assert all(r["layout"]["pp"] == 2 for r in records)
    assert "pp2" in out.stdout and "step    3/3" in out.stdout


def test_memory_dry_run_reports_each_stage():
    out = cli_here("memory", "--model", "70b", "--pp", "8", "--tp", "8", "--dp", "4", "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip().startswith("stage ")]
    assert len(lines) == 8
    assert lines[0].strip().startswith("stage 0: layers 0-9 + embedding, 9.61B parameters; 300.3M on each")
    assert lines[3].strip().startswith("stage 3: layers 30-39, 8.56B parameters; 267.4M on each")
    assert "4.28 GB per rank" in lines[3] and "norm + head" in lines[7]


def test_stage_split_is_even_or_as_listed_and_keeps_the_one_process_names():
    assert split_layers(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert split_layers(8, 2, [5, 3]) == [range(0, 5), range(5, 8)]
    stage = build_stage(small_config(n_layers=8).model_config, 1, 2, range(5, 8))
    assert stage.tok_embeddings is None and stage.norm is not None and stage.output is not None
    assert sorted({n.split(".")[1] for n, _ in stage.named_parameters() if n.startswith("layers.")}) == ["5", "6", "7"]
    assert all(p.is_meta for p in stage.parameters())


def _init_from(config, file):
    from helpers import gather_by_name, named_full_parameters
    from tessera.checkpointing import checkpoint
    from tessera.trainer import Trainer

    trainer = Trainer(config, torch.device("cpu"))
    for part in trainer.parts:
        checkpoint.load_full_state_dict(part, file)
    merged = gather_by_name(named_full_parameters(trainer))
    return merged if trainer.rank == 0 else None


def test_init_from_a_full_state_dict_fills_every_stage(tmp_path):
    from tessera.models import build_model
    from tessera.checkpointing.checkpoint import write_safetensors

    config = small_config(**PIPELINE_BASE, pp=2, tp=2, microbatches=2)
    source = build_model(config.model_config, seed=7)
    file = tmp_path / "weights.safetensors"
    write_safetensors({k: v.detach() for k, v in source.state_dict().items()}, file)
    got = run_ranks(_init_from, 4, config, str(file), timeout=120)[0]
    assert sorted(got) == sorted(n for n, _ in source.named_parameters())
    assert all(torch.equal(got[n], p.detach()) for n, p in source.named_parameters())


def _stage_one_never_answers(config):
    import time

    from tessera.parallel.comm import CollectiveTimeout
    from tessera.trainer import Trainer

    trainer = Trainer(config, torch.device("cpu"))
    if trainer.rank == 1:
        time.sleep(6)  # stays out of the pipeline until rank 0 has given up
        return None
    try:
        trainer.train_step()
    except CollectiveTimeout as e:
        return str(e)
    return "no timeout"


def test_a_stage_that_never_answers_fails_naming_the_rank_axis_and_message():
    config = small_config(**PIPELINE_BASE, pp=2, microbatches=2, timeout=2.0)
    message = run_ranks(_stage_one_never_answers, 2, config, timeout=60)[0]
    assert message.startswith(
        "rank 0 stalled at training step 1 in recv grad of microbatch 0 for stage 0 over the pp axis"
    ), message


def _cpu_runner(cfg, stages: dict, schedule, microbatches: int, virtual: int, **kwargs):
    """A PipelineRunner of this rank's `stages` on the WORLD group on CPU: cfg's loss and float32 hidden states
    of cfg.dim between stages (called inside run_ranks)."""
    import torch.distributed as dist

    from tessera.parallel.loss import CrossEntropySum
    from tessera.parallel.pipeline import PipelineRunner

    def activation(rows: int, seq: int):
        return (rows, seq, cfg.dim), torch.float32

    return PipelineRunner(
        stages,
        schedule,
        dist.group.WORLD,
        microbatches,
        virtual,
        CrossEntropySum(cfg.vocab_size),
        activation,
        torch.device("cpu"),
        **kwargs,
    )


def _a_stage_casts_its_output():
    """Two 1F1B stages where stage 0 hands over float64 hidden states where float32 ones are declared."""
    import torch.distributed as dist

    from tessera.models import get_preset
    from tessera.parallel import materialize

    cfg = get_preset("debug", n_layers=2)
    rank = dist.get_rank()
    part = materialize(build_stage(cfg, rank, 2, range(rank, rank + 1)), "cpu", seed=0)
    if rank == 0:
        forward = part.forward
        part.forward = lambda *args, **kwargs: forward(*args, **kwargs).double()
    runner = _cpu_runner(cfg, {rank: part}, "1f1b", 2, 1, timeout=30)
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(3))
    runner.forward_backward(list(zip(tokens[:, :-1].chunk(2), tokens[:, 1:].chunk(2))), 64)


def test_a_stage_whose_output_does_not_match_the_next_stages_input_is_named_at_its_first_forward():
    """Not a hang, nor a receive of the wrong bytes: the sending stage fails at once, naming what it produced and
    what the boundary carries (the launcher reports it within its 60 s, before the peer's 30 s receive timeout)."""
    with pytest.raises(
        Exception,
        match=r"pipeline stage 0 produced act of \(2, 16, \d+\) torch\.float64 for microbatch 0; "
        r"stage boundaries carry \(2, 16, \d+\) torch\.float32",
    ):
        run_ranks(_a_stage_casts_its_output, 2, timeout=60)


def _custom_schedule_gradients(schedule):
    """Run a hand-written schedule on 2 pp ranks; return every parameter's gradient (merged on rank 0)."""
    import torch.distributed as dist

    from helpers import gather_by_name
    from tessera.models import get_preset
    from tessera.parallel import materialize

    cfg = get_preset("debug", n_layers=4)
    rank = dist.get_rank()
    stages = {s: materialize(build_stage(cfg, s, 4, range(s, s + 1)), "cpu", seed=0) for s in (rank, rank + 2)}
    runner = _cpu_runner(cfg, stages, schedule, 2, 2)
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(3))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    loss = runner.forward_backward(list(zip(inputs.chunk(2), targets.chunk(2))), targets.numel())
    grads = gather_by_name({n: p.grad.clone() for m in stages.values() for n, p in m.named_parameters()})
    return loss, grads, inputs, targets


def test_a_hand_written_schedule_runs_and_a_deadlocking_one_is_refused():
    from tessera.models import build_model, get_preset
    from tessera.topology.schedules.schedule import Action

    # depth-first over 4 virtual stages on 2 ranks: microbatch 0 all the way down and back, then microbatch 1
    def rank_actions(r):
        out = []
        for mb in range(2):
            out += [Action("F", mb, r), Action("F", mb, r + 2), Action("B", mb, r + 2), Action("B", mb, r)]
        return out

    schedule = [rank_actions(0), rank_actions(1)]
    (_, grads, inputs, targets), (loss, *_) = run_ranks(_custom_schedule_gradients, 2, schedule, timeout=120)
    # the loss lives on the rank of the last stage (rank 1); gradients are gathered on rank 0
    model = build_model(get_preset("debug", n_layers=4), seed=0)
    logits = model(inputs)
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    ref.backward()
    assert abs(loss.item() / targets.numel() - ref.item()) <= 1e-6 * ref.item()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)

    swapped = [schedule[0], [schedule[1][1], schedule[1][0]] + schedule[1][2:]]  # rank 1 runs stage 3 before 1
    with pytest.raises(Exception, match="deadlocks"):
        run_ranks(_custom_schedule_gradients, 2, swapped, timeout=120)


def _module_outputs_alive_at_each_w():
    """One rank, a split backward by hand (F0 F1 B0 B1 W0 W1): how many outputs of the blocks' attention and
    MLP projections (wo, w2: added to the residual, so no backward saves them) are still alive when each W
    starts, and the gradients against a plain backward of the same model and batch."""
    import gc
    import weakref

    from tessera.models import get_preset
    from tessera.parallel import materialize
    from tessera.topology.schedules.schedule import Action

    cfg = get_preset("debug", n_layers=2)
    part = materialize(build_stage(cfg, 0, 1, range(2)), "cpu", seed=0)
    outputs: list[weakref.ref] = []
    for name, module in part.named_modules():
        if name.endswith((".wo", ".w2")):
            module.register_forward_hook(lambda m, args, out: outputs.append(weakref.ref(out)))
    schedule = [[Action(op, mb, 0) for op, mb in (("F", 0), ("F", 1), ("B", 0), ("B", 1), ("W", 0), ("W", 1))]]
    runner = _cpu_runner(cfg, {0: part}, schedule, 2, 1)
    alive_at_w = []
    run_w = runner._W

    def counting_w(a, k, received):
        gc.collect()
        alive_at_w.append(sum(ref() is not None for ref in outputs))
        run_w(a, k, received)

    runner._W = counting_w
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(3))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    runner.forward_backward(list(zip(inputs.chunk(2), targets.chunk(2))), targets.numel())
    made = len(outputs)
    split = {n: p.grad.clone() for n, p in part.named_parameters()}
    part.zero_grad(set_to_none=True)
    logits = part(inputs, torch.arange(inputs.shape[1]))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    whole = {n: p.grad.clone() for n, p in part.named_parameters()}
    return made, alive_at_w, split, whole


def test_a_split_backward_holds_no_module_output_until_its_weight_pass():
    """Between B and W the executor keeps where each module's output enters the graph (a gradient edge), not
    the output: the attention and MLP outputs that no backward saves are freed at B, as in one whole
    backward (holding them cost zb-h1 8 MiB per rank over torch's executor in the benchmark)."""
    made, alive_at_w, split, whole = run_ranks(_module_outputs_alive_at_each_w, 1, timeout=120)[0]
    assert made == 8  # 2 microbatches x 2 blocks x (wo, w2)
    assert alive_at_w == [0, 0]
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-5, atol=1e-7)


def _this_ranks_runner(cfg, kind: str, pp: int, virtual: int, microbatches: int):
    """(stages, runner) of this rank for `kind` on the WORLD group: cfg's layers split evenly over pp x virtual
    stages, each materialized from seed 0 on CPU (called inside run_ranks)."""
    import torch.distributed as dist

    from tessera.parallel import materialize
    from tessera.topology.schedules.schedule import placement_of

    n_stages = pp * virtual
    mine = stages_of_rank(dist.get_rank(), pp, virtual, placement_of(kind))
    stages = {
        s: materialize(build_stage(cfg, s, n_stages, split_layers(cfg.n_layers, n_stages)[s]), "cpu", seed=0)
        for s in mine
    }
    runner = _cpu_runner(cfg, stages, kind, microbatches, virtual)
    return stages, runner


def _peak_held_by_kind(pp: int, kinds: list[tuple[str, int, int]]):
    """Each kind's step on `pp` ranks (debug model, one block per stage): the most microbatch-stages whose
    activations the executor held at once on this rank, and the step's gradients (merged on rank 0)."""
    import torch.distributed as dist

    from helpers import gather_by_name
    from tessera.models import get_preset

    out = {}
    for kind, virtual, microbatches in kinds:
        cfg = get_preset("debug", n_layers=pp * virtual)
        stages, runner = _this_ranks_runner(cfg, kind, pp, virtual, microbatches)
        tokens = torch.randint(0, cfg.vocab_size, (microbatches, 9), generator=torch.Generator().manual_seed(3))
        runner.forward_backward(
            list(zip(tokens[:, :-1].chunk(microbatches), tokens[:, 1:].chunk(microbatches))), 8 * microbatches
        )
        grads = gather_by_name({n: p.grad.clone() for m in stages.values() for n, p in m.named_parameters()})
        peaks = [None] * pp
        dist.all_gather_object(peaks, runner.peak_in_flight)
        out[kind] = (peaks, grads, tokens)
    return out


KINDS_RUN = [
    ("gpipe", 1, 4),
    ("1f1b", 1, 4),
    ("zb-h1", 1, 4),
    ("interleaved-1f1b", 2, 4),
    ("looped-bfs", 2, 4),
    ("interleaved-zb", 2, 4),
    ("zbv", 2, 4),
    ("dualpipev", 2, 8),
]


@pytest.mark.parametrize("pp", [2, 4])
def test_every_kind_holds_the_activations_the_simulator_says_and_computes_the_one_process_gradients(pp):
    """Per rank, the executor's peak of held activations (a stage's forward run, its backward -- or W --
    not yet) equals the simulator's for every schedule kind, V placement included; and every kind's
    gradients equal one process's."""
    from tessera.models import build_model, get_preset
    from tessera.topology.schedules.schedule import build_schedule
    from tessera.topology.schedules.simulator import simulate

    results = run_ranks(_peak_held_by_kind, pp, pp, KINDS_RUN, timeout=300)[0]
    for kind, virtual, microbatches in KINDS_RUN:
        peaks, grads, tokens = results[kind]
        assert peaks == simulate(build_schedule(kind, pp, microbatches, virtual)).peak_held_activations, kind
        model = build_model(get_preset("debug", n_layers=pp * virtual), seed=0)
        torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=f"{kind} {name}")


def test_the_pipeline_benchmark_runs_the_new_kinds_beside_torchs(tmp_path):
    """benchmarks/bench_pipeline.py, small: tessera's looped-bfs, interleaved-zb, zbv and dualpipev against torch's
    classes of the same kind compute the same gradients; the record holds the ratio of the times it holds."""
    import json

    kinds = "looped-bfs,interleaved-zb,zbv,dualpipev"
    small = ["--model", "debug", "--n-layers", "4", "--microbatches", "4", "--rows", "1", "--seq-len", "16"]
    out = script_here("bench_pipeline", *small, "--steps", "3", "--warmup", "0", "--kinds", kinds, "--out", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "pipeline-debug-pp2-cpu.json").read_text())["results"]
    assert [r["kind"] for r in rows] == ["looped-bfs", "interleaved-zb", "zbv", "dualpipev"]
    for r in rows:
        assert r["grad_max_rel_diff"] < 1e-5, r
        assert r["torch_over_tessera_of_medians"] == pytest.approx(r["torch_step_s"] / r["tessera_step_s"])
        times = r["step_times"]  # the ratio: the median of each step's pair (torch's over tessera's before it)
        paired = sorted(b / a for a, b in zip(times["tessera"], times["torch"]))
        assert len(paired) == 3 and r["torch_over_tessera"] == pytest.approx(paired[1])
        low, high = r["torch_over_tessera_quartiles"]
        assert paired[0] <= low <= r["torch_over_tessera"] <= high <= paired[2]


def _traces_by_kind(pp, kinds):
    """Each kind's steps on `pp` ranks with stages large enough that compute outweighs messages: the
    executor's traces of two steps after a warm-up (one clock: time.perf_counter is system-wide on Linux),
    per rank. The garbage collector is held off over the steps: a full collection on one rank between two of
    its actions is idle time in no action, which the other rank waits out (once seen as looped-bfs measured
    0.168 against 0.124 simulated, in both steps)."""
    import gc

    import torch.distributed as dist

    from tessera.models import get_preset

    out = {}
    cfg = get_preset("small", n_layers=2 * pp)
    for kind, virtual, microbatches in kinds:
        _, runner = _this_ranks_runner(cfg, kind, pp, virtual, microbatches)
        tokens = torch.randint(0, cfg.vocab_size, (2 * microbatches, 257), generator=torch.Generator().manual_seed(3))
        batch = list(zip(tokens[:, :-1].chunk(microbatches), tokens[:, 1:].chunk(microbatches)))
        out[kind] = []
        for record in (False, True, True):  # a warm-up step, then two traced ones
            gc.collect()
            dist.barrier()
            gc.disable()
            try:
                runner.record_trace = record
                runner.forward_backward(batch, tokens[:, 1:].numel())
            finally:
                gc.enable()
            if record:
                traces = [None] * pp
                dist.all_gather_object(traces, [(s, e, tuple(a)) for s, e, a in runner.trace])
                out[kind].append(traces)
    return out


def test_every_kinds_measured_bubble_is_the_simulated_one():
    """The executor realizes each schedule's bubble: the idle share measured from its trace on two ranks equals
    the simulator's for the same schedule with each action's measured duration (a full backward run with its
    W: the W costs nothing), within 0.03 -- message latency and the executor's own bookkeeping are all that
    the simulator leaves out. Of two steps the faster is judged (the one least disturbed by the machine)."""
    from tessera.topology.schedules.schedule import Action, build_schedule
    from tessera.topology.schedules.simulator import bubble_of, simulate

    kinds = [(kind, virtual, 2 * m if kind == "dualpipev" else m) for kind, virtual, m in KINDS_RUN]
    results = run_ranks(_traces_by_kind, 2, 2, kinds, timeout=600)[0]
    rows = []
    for kind, virtual, microbatches in kinds:
        steps = [[[(s, e, Action(*a)) for s, e, a in row] for row in step] for step in results[kind]]
        traces = min(steps, key=lambda t: max(row[-1][1] for row in t) - min(row[0][0] for row in t))
        durations = {a: e - s for row in traces for s, e, a in row}
        schedule = build_schedule(kind, 2, microbatches, virtual)
        simulated = simulate(schedule, {"F": 0.0, "B": 0.0, "W": 0.0}, durations=durations).bubble
        measured = bubble_of(traces)
        print(f"{kind}: measured {measured:.3f} simulated {simulated:.3f}")
        rows.append((kind, measured, simulated))
    assert all(abs(m - s) <= 0.03 for _, m, s in rows), rows

"""One training configuration: nested frozen dataclasses, validated once, before any rank starts.

Every field carries its flag and a one-line doc in its metadata; the `tessera train` command line is
built from these fields (`add_arguments`), so defaults are written here and nowhere else. `check()`
raises ValueError naming the value and the fix; `to_dict()` is what the checkpoint manifest and the
metrics header record.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Mapping

from tessera.metrics.loggers import check_loggers
from tessera.topology import Layout
from tessera.topology import axes as _axes
from tessera.topology.errors import TesseraError, with_flags
from tessera.topology.schedule import V_KINDS, fewest_microbatches
from tessera.topology.schedule_files import read_schedule_file


def opt(default: Any, doc: str, flag: str | None = None, **argparse_kw: Any) -> Any:
    """A config field: its default, its one-line doc, and (optionally) its flag name and argparse extras."""
    return field(default=default, metadata={"doc": doc, "flag": flag, "argparse": argparse_kw})


def degree_opt(name: str) -> Any:
    """The degree field of the axis whose flag is `name`: default 1, its help from topology/axes.py's table."""
    axis = next(a for a in _axes.TABLE if a.flag == name)
    return opt(1, axis.help, metavar="N")


@dataclass(frozen=True)
class ModelSection:
    preset: str = opt(
        "debug",
        "model preset of a registered family: llama (debug, small, 1b, 8b, 70b, "
        "405b), qwen3 (qwen3-debug, qwen3-0.6b, qwen3-1.7b, qwen3-8b), qwen3_moe (qwen3-moe-debug, qwen3-30b-a3b, "
        "qwen3-235b-a22b); or hf:DIR (a Hugging Face "
        "config.json, the family from its model_type)",
        flag="--model",
        metavar="PRESET",
    )
    n_layers: int | None = opt(None, "override the preset's number of transformer blocks", metavar="N")
    vocab_size: int | None = opt(None, "override the preset's vocabulary (e.g. a tokenizer's for --data)", metavar="V")
    moe_aux_loss: float | None = opt(
        None,
        "MoE models: the sequence-level auxiliary loss's weight (0: off; default: the preset's, 0.001 for Qwen3-MoE)",
        metavar="COEF",
    )
    moe_bias_rate: float | None = opt(
        None,
        "MoE models: the auxiliary-loss-free bias's step per optimizer step (DeepSeek-V3: 0.001; default 0: off)",
        metavar="RATE",
    )


@dataclass(frozen=True)
class ParallelSection:
    # one degree per axis of topology/axes.py's table (its flag and help; --dp gives dp_replicate x dp_shard)
    pp: int = degree_opt("pp")
    dp: int = degree_opt("dp")
    dp_replicate: int = degree_opt("dp_replicate")
    cp: int = degree_opt("cp")
    tp: int = degree_opt("tp")
    ep: int = degree_opt("ep")
    sequence_parallel: bool = opt(False, "shard the norms and the residual stream over tp")
    fsdp: str = opt(
        "FULL_SHARD", "FSDP strategy: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD", metavar="STRATEGY"
    )
    ac: str = opt(
        "none",
        "activation checkpointing: none, full, selective (every other block) or op (keep matmul and "
        "attention outputs, recompute the rest)",
        metavar="MODE",
    )
    mixed_precision: str | None = opt(
        None, "parameter compute dtype, bf16 or fp32 (default: bf16 on GPU, fp32 on CPU)", metavar="bf16|fp32"
    )
    prefetch: int = opt(0, "explicit FSDP all-gather prefetch of N blocks (0: FSDP2's implicit prefetch)", metavar="N")
    compile: bool = opt(
        False,
        "torch.compile each transformer block (after tp, cp and checkpointing, before FSDP2; the "
        "first step compiles, on CPU through a C++ compiler)",
    )
    schedule: str | None = opt(
        None,
        "pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1, looped-bfs, interleaved-zb, zbv or "
        "dualpipev (default with --pp > 1: 1f1b)",
        metavar="KIND",
    )
    schedule_file: str | None = opt(
        None,
        "a pipeline schedule as data instead of --schedule: CSV, one line per pp rank "
        "of actions STAGE OP MICROBATCH (0F1: stage 0's forward of microbatch 1; B "
        'backward, W weight gradient), or JSON {"ranks": [["0F0", ...], ...]}; '
        "proven by the simulator before any rank starts; its microbatches are the "
        "default of --microbatches",
        metavar="PATH",
    )
    virtual: int | None = opt(
        None,
        "virtual pipeline stages per pp rank (interleaved-1f1b, looped-bfs, interleaved-zb: stage s on rank s % pp; "
        "default 1, and 2 for zbv and dualpipev, which run two per rank on a V)",
        metavar="V",
    )
    pp_layers: str | None = opt(
        None, "transformer blocks per stage, e.g. 3,3,2 (default: an even split)", metavar="N,N,..."
    )
    cp_method: str | None = opt(
        None,
        "context-parallel attention: ring (K/V pass the ring, overlapped) or allgather (K/V gathered once per layer); "
        "default with --cp > 1: ring",
        metavar="ring|allgather",
    )
    loss: str = opt(
        "chunked",
        "the loss: chunked (fused linear cross-entropy over token chunks, never the full fp32 "
        "logits) or logits (the full logits, then cross-entropy)",
        metavar="chunked|logits",
    )

    @property
    def layers_per_stage(self) -> tuple[int, ...] | None:
        """--pp-layers as integers (None: an even split)."""
        if self.pp_layers is None:
            return None
        text = self.pp_layers if isinstance(self.pp_layers, str) else ",".join(map(str, self.pp_layers))
        try:
            return tuple(int(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"--pp-layers {text!r} must be comma-separated layer counts, e.g. 3,3,2") from None

    @property
    def layout(self) -> Layout:
        """The mesh shape these degrees ask for (NO_SHARD puts every dp rank on dp_replicate)."""
        return self.layout_for()

    def layout_for(self, global_batch: int | None = None) -> Layout:
        """`layout`; given the `global_batch`, degrees that do not make one are answered with a fix that also
        splits it (--dp 4 --dp-replicate 3 suggested --dp 3, which the batch of 8 then refused)."""
        from tessera.parallel.data import layout_for_strategy  # lazy: torch stays out of `tessera --help`

        flags = {name: getattr(self, name) for name in DEGREE_FLAGS}
        layout = Layout(**_axes.degrees_from_flags(flags, global_batch=global_batch))
        return layout_for_strategy(layout, self.fsdp.upper())


@dataclass(frozen=True)
class OptimizerSection:
    optimizer: str = opt(
        "adamw",
        "adamw, or muon: Muon on the model spec's hidden weight matrices (attention, MLP, experts), AdamW on the "
        "rest (embeddings, head, norms, routers); docs/optimizers.md",
        choices=("adamw", "muon"),
        metavar="NAME",
    )
    lr: float = opt(3e-3, "peak learning rate of AdamW", metavar="RATE")
    warmup: int = opt(5, "linear warm-up steps before the cosine decay", metavar="STEPS")
    min_lr_ratio: float = opt(0.1, "the cosine decays to this fraction of the peak learning rate", metavar="RATIO")
    weight_decay: float = opt(0.1, "AdamW decoupled weight decay", metavar="COEF")
    beta1: float = opt(0.9, "AdamW first-moment decay", metavar="BETA")
    beta2: float = opt(0.95, "AdamW second-moment decay", metavar="BETA")
    eps: float = opt(1e-8, "AdamW epsilon", metavar="EPS")
    max_grad_norm: float = opt(
        1.0, "clip the global gradient norm (over every axis) to this; 'inf' disables clipping", metavar="NORM"
    )
    muon_lr: float = opt(0.02, "--optimizer muon: peak learning rate of Muon's matrices", metavar="RATE")
    muon_momentum: float = opt(0.95, "--optimizer muon: momentum", metavar="MU")
    muon_nesterov: bool = opt(True, "--optimizer muon: Nesterov momentum (--no-muon-nesterov: plain)")
    muon_ns_steps: int = opt(5, "--optimizer muon: Newton-Schulz iterations (1-99)", metavar="N")
    muon_ns_coefficients: str = opt(
        "3.4445,-4.7750,2.0315", "--optimizer muon: the Newton-Schulz quintic's coefficients a,b,c", metavar="A,B,C"
    )
    muon_weight_decay: float = opt(0.1, "--optimizer muon: decoupled weight decay of the matrices", metavar="COEF")
    muon_update_scale: str = opt(
        "original",
        "--optimizer muon: the update's scale, as torch.optim.Muon's adjust_lr_fn: original (sqrt(max(1, rows/cols))) "
        "or match_rms_adamw (0.2 sqrt(max(rows, cols)))",
        metavar="NAME",
    )

    def ns_coefficients(self) -> tuple[float, float, float]:
        """--muon-ns-coefficients as three floats (ValueError naming the flag otherwise)."""
        try:
            a, b, c = (float(x) for x in self.muon_ns_coefficients.split(","))
        except ValueError:
            raise ValueError(
                f"muon_ns_coefficients={self.muon_ns_coefficients!r} is not three numbers a,b,c; e.g. "
                "muon_ns_coefficients=3.4445,-4.7750,2.0315"
            ) from None
        return a, b, c


@dataclass(frozen=True)
class DataSection:
    seq_len: int = opt(64, "tokens per sequence", metavar="N")
    global_batch: int = opt(8, "sequences per optimizer step, over all data-parallel ranks", metavar="N")
    microbatches: int | None = opt(
        None,
        "split each dp rank's rows into M microbatches (gradient accumulation; "
        "default 1, and with --pp the fewest the schedule needs that divide the "
        "rows: --pp for 1f1b, zb-h1 and interleaved-1f1b; a --schedule-file's "
        "own count)",
        metavar="M",
    )
    eval_data: str | None = opt(None, "held-out token files for --eval-every (same format as --data)", metavar="PATH")
    eval_every: int = opt(
        0, "every N steps, the mean loss on --eval-batches global batches of --eval-data (0: never)", metavar="N"
    )
    eval_batches: int = opt(1, "global batches of --eval-data per evaluation (the same ones each time)", metavar="K")
    path: str | None = opt(
        None,
        "token files (a .bin shard with its .json, or a directory of them) from `tessera "
        "tokenize`; default: the text shipped with tessera, byte-tokenized",
        flag="--data",
        metavar="PATH",
    )
    pack_documents: bool = opt(
        False,
        "train on packed documents: each token attends only to its own document "
        "(positions restart at each), and the target after a document's separator "
        "is left out of the loss; documents end at --data's separator token (the "
        "shipped text: each paragraph is one)",
        flag="--pack-documents",
    )


@dataclass(frozen=True)
class CheckpointSection:
    dir: str | None = opt(
        None, "where checkpoints go (step_N/ and a latest pointer)", flag="--checkpoint-dir", metavar="DIR"
    )
    every: int = opt(0, "save every N steps (0: never)", flag="--checkpoint-every", metavar="N")
    keep: int = opt(3, "keep the newest K checkpoints (0: keep all)", flag="--keep-checkpoints", metavar="K")
    resume: str | None = opt(
        None,
        "resume from a checkpoint (default: the latest in --checkpoint-dir), on any layout",
        nargs="?",
        const="",
        metavar="PATH",
    )
    init_from: str | None = opt(None, "start from the weights of a full safetensors state dict", metavar="FILE")
    init_from_hf: str | None = opt(
        None,
        "start from a Hugging Face directory (config.json + safetensors) of a supported family (Llama, Qwen3, "
        "Qwen3-MoE: by its model_type); the model is read from its config.json",
        metavar="DIR",
        flag="--init-from-hf",
    )
    on_signal: bool = opt(
        False,
        "on SIGTERM, every rank finishes its step and saves a checkpoint before stopping",
        flag="--checkpoint-on-signal",
    )
    asynchronous: bool = opt(
        False,
        "save in the background (DCP's async save): training waits only while the state "
        "is copied to host memory; a checkpoint becomes latest once every rank wrote it",
        flag="--checkpoint-async",
    )


MAX_SKIPPED_STEPS = 5  # --max-skipped-steps when not given


@dataclass(frozen=True)
class RuntimeSection:
    steps: int = opt(50, "optimizer steps to train (the total, counted from step 0 when resuming)", metavar="N")
    seed: int = opt(0, "seed of the initialization", metavar="N")
    metrics: str | None = opt(None, "append a header record, then one JSON line per step, to this file", metavar="FILE")
    tensorboard: str | None = opt(
        None,
        "also write each step's scalars (loss, grad norm, lr, tokens/s, memory, eval loss, bytes per axis, ...) as "
        "TensorBoard event files in this directory, from rank 0, flushed every step (needs the tensorboard extra)",
        metavar="DIR",
    )
    wandb: str | None = opt(
        None,
        "also log each step's scalars to this Weights & Biases project, from rank 0 (needs the wandb extra; "
        "offline with WANDB_MODE=offline or when online fails; a --resume continues the run)",
        metavar="PROJECT",
    )
    timeout: float = opt(
        600.0, "seconds any collective may stall before the run fails, naming the rank and axis", metavar="SECONDS"
    )
    device: str = opt(
        "auto", "cpu or cuda (auto: one GPU per rank when this machine has enough, else CPU)", metavar="auto|cpu|cuda"
    )
    kernels: str = opt(
        "auto",
        "attention and RMSNorm: auto (Triton kernels on CUDA, torch's fused ops on CPU), torch or triton",
        metavar="auto|torch|triton",
    )
    quiet: bool = opt(False, "no start-up or progress lines")
    check_drift: bool = opt(
        False,
        "after the run, train this config on one process at 1, 2 and 4 microbatches (only "
        "the order of its sums differs) and judge each step's loss and grad norm against "
        "that spread: a step more than 2x it (and 1e-5) from one process is named and the "
        "command exits 1; the model must fit one process",
        flag="--check-drift",
    )
    track_memory: bool = opt(
        False,
        "measure the peak tensor storage of step 2 (every live tensor, re-read around each "
        "operator: a slow step) into the metrics' peak_tensor_bytes",
    )
    comm_stats: str | None = opt(
        None,
        "count the bytes each mesh axis and collective sends, every step or the first "
        "only (rank 0's, in the metrics beside the analytic volumes; a Python call "
        "per operator while counting)",
        nargs="?",
        const="every",
        choices=("every", "first"),
        metavar="every|first",
    )
    max_restarts: int = opt(
        0,
        "when a rank fails, restart every rank from the latest checkpoint up to N times "
        "(under torchrun: its --max-restarts)",
        metavar="N",
    )
    on_nonfinite: str = opt(
        "stop",
        "a NaN or inf loss or gradient: stop (name it, apply and save nothing) or skip (drop that step's update)",
        metavar="stop|skip",
    )
    max_skipped_steps: int | None = opt(
        None,
        "with --on-nonfinite skip: after N skipped steps in a row, the next "
        "non-finite step stops the run as --on-nonfinite stop does (default: "
        "5)",
        metavar="N",
    )
    profile: str | None = opt(
        None,
        "trace --profile-steps with torch.profiler: every rank writes DIR/rank{R}.trace.json "
        "(Perfetto / chrome://tracing JSON); rank 0 prints its top ops by self time at the end",
        metavar="DIR",
    )
    profile_steps: str | None = opt(
        None,
        "the steps --profile records, A:B inclusive (default: the run's 2nd and 3rd "
        "steps, leaving out the first step's warm-up)",
        metavar="A:B",
    )
    profile_shapes: bool = opt(
        False, "with --profile: record each op's input shapes too (larger traces; the table groups ops by shape)"
    )
    force: bool = opt(
        False,
        "run even when the planner's memory estimate exceeds this machine's memory (host RAM shared by the "
        "local CPU ranks, or a GPU's): by default such a run is refused before any rank starts",
    )
    profile_summary: int | None = opt(
        None,
        "profile step N (torch.profiler and the allocator; N >= 2, after the warm-up step) into its metrics "
        "record's 'profile': the step's time by kind (matmul, attention, norms, loss, optimizer, casts, "
        "communication, device idle), the top 25 kernels, and the memory peak by what held it",
        metavar="N",
    )

    @property
    def skip_limit(self) -> int:
        """Skipped steps in a row that --on-nonfinite skip allows (--max-skipped-steps, else its default)."""
        return MAX_SKIPPED_STEPS if self.max_skipped_steps is None else self.max_skipped_steps


SECTIONS = {
    "model": ModelSection,
    "parallel": ParallelSection,
    "optimizer": OptimizerSection,
    "data": DataSection,
    "checkpoint": CheckpointSection,
    "runtime": RuntimeSection,
}


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    if TYPE_CHECKING:  # set by __post_init__, not a field: to_dict() (the manifest, the metrics header) omits it
        microbatches_chosen: bool = field(init=False)

    def __post_init__(self) -> None:
        # --virtual left out: the V kinds' two stages per rank, else one
        if self.parallel.virtual is None:
            virtual = 2 if self.parallel.schedule in V_KINDS else 1
            object.__setattr__(self, "parallel", dataclasses.replace(self.parallel, virtual=virtual))
        # --microbatches left out: 1, or with a pipeline the fewest its schedule runs (which `microbatches_chosen`
        # says, for the start line), so that `--pp 2` alone trains; a --schedule-file's own count when given
        if self.data.microbatches is None:
            from_file = self._schedule_file_microbatches()  # a schedule file fixes its own count
            chosen = from_file or self._default_microbatches()
            object.__setattr__(self, "data", dataclasses.replace(self.data, microbatches=chosen))
            object.__setattr__(self, "microbatches_chosen", from_file is None)
        else:
            object.__setattr__(self, "microbatches_chosen", False)

    def _schedule_file_microbatches(self) -> int | None:
        """The microbatches --schedule-file runs (None without one, or when it does not parse: the checks
        then name the problem)."""
        if self.parallel.schedule_file is None:
            return None
        try:
            actions = [a for row in read_schedule_file(self.parallel.schedule_file) for a in row]
        except ValueError:
            return None
        return max((a.microbatch for a in actions), default=-1) + 1 or None

    def _default_microbatches(self) -> int:
        p = self.parallel
        try:
            pp = self.layout.pp
        except ValueError:  # degrees that do not make a layout: the checks say so later
            return 1
        if pp == 1:
            return 1
        kind = p.schedule or "1f1b"
        least = fewest_microbatches(kind, pp, self.virtual)
        step = pp if kind in ("interleaved-1f1b", "interleaved-zb") and self.virtual > 1 else 1  # rounds of pp
        rows = self.data.global_batch // max(1, self.layout.dp)
        # the fewest that also divides each dp rank's rows (else the schedule's least: the checks name the fix)
        return next((m for m in range(least, rows + 1, step) if rows % m == 0), least)

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, **flat: Any) -> "Config":
        """A config from flat field names, e.g. Config.create(model="small", tp=2, steps=10). A name that
        two sections share is not allowed; section fields are found by their flag name too (checkpoint_dir)."""
        by_name = _flat_names()
        parts: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for key, value in flat.items():
            if key not in by_name:
                raise ValueError(f"unknown config field {key!r}; known: {', '.join(sorted(by_name))}")
            section, name = by_name[key]
            parts[section][name] = value
        return cls(**{s: SECTIONS[s](**kw) for s, kw in parts.items()})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ derived values
    @property
    def layout(self) -> Layout:
        """The mesh shape this config runs, computed once per config (its degrees and batch are frozen)."""
        built = self.__dict__.get("_layout")
        if built is None:
            built = self.parallel.layout_for(self.data.global_batch)
            object.__setattr__(self, "_layout", built)  # a cache, not a field, as parallel_config's
        return built

    @property
    def virtual(self) -> int:
        """--virtual as this config runs it: parallel.virtual, which __post_init__ fills in when not given."""
        assert self.parallel.virtual is not None, "Config.__post_init__ sets parallel.virtual"
        return self.parallel.virtual

    @property
    def microbatches(self) -> int:
        """--microbatches as this config runs it: data.microbatches, which __post_init__ fills in when not given."""
        assert self.data.microbatches is not None, "Config.__post_init__ sets data.microbatches"
        return self.data.microbatches

    @property
    def model_name(self) -> str:
        """The preset's name, or hf:DIR for a model read from a Hugging Face config.json."""
        return f"hf:{self.checkpoint.init_from_hf}" if self.checkpoint.init_from_hf else self.model.preset

    @property
    def model_config(self):
        """The model's config: any registered family's preset (models.spec.get_preset), with --n-layers /
        --vocab-size applied, or the config.json of --init-from-hf / --model hf:DIR read by the family its
        model_type names (models.hf.read_hf_config)."""
        # lazy: torch stays out of `tessera --help` (importing tessera.models registers every family)
        from tessera.models import get_preset

        overrides = {} if self.model.n_layers is None else {"n_layers": self.model.n_layers}
        if self.model.vocab_size is not None:
            overrides["vocab_size"] = self.model.vocab_size
        moe = {"aux_loss_coef": self.model.moe_aux_loss, "bias_rate": self.model.moe_bias_rate}
        for value, flag in zip(moe.values(), ("--moe-aux-loss", "--moe-bias-rate")):
            if value is not None and (not isinstance(value, (int, float)) or value < 0 or value != value):
                raise ValueError(f"{flag} {value} must be a number >= 0")
        moe = {k: float(v) for k, v in moe.items() if v is not None}
        hf_dir = self.checkpoint.init_from_hf or (
            self.model.preset[3:] if self.model.preset.startswith("hf:") else None
        )

        if hf_dir is None:
            cfg = get_preset(self.model.preset, **overrides)
        else:
            from tessera.models.hf import compare_with_preset, read_hf_config  # lazy: (as above) torch

            cfg = read_hf_config(hf_dir, flag="init_from_hf" if self.checkpoint.init_from_hf else "preset=hf:")
            if overrides:
                raise ValueError(
                    f"--n-layers / --vocab-size with a Hugging Face model ({hf_dir}): its config.json fixes "
                    f"them; drop them"
                )
            preset = self.model.preset
            if preset != "debug" and not preset.startswith("hf:"):  # a --model given as well must agree
                compare_with_preset(cfg, get_preset(preset), preset)
        if moe and not hasattr(cfg, "n_experts"):
            flag = "--moe-aux-loss" if "aux_loss_coef" in moe else "--moe-bias-rate"
            raise ValueError(
                f"{flag} needs a mixture-of-experts model, and {self.model_name} has no experts; "
                f"use e.g. --model qwen3-moe-debug, or drop {flag}"
            )
        return dataclasses.replace(cfg, **moe)

    @property
    def mixed_precision(self) -> str:
        if self.parallel.mixed_precision is not None:
            return self.parallel.mixed_precision
        return "bf16" if self.device_type() == "cuda" else "fp32"

    def device_type(self) -> str:
        """cpu or cuda; auto picks CUDA when this machine has a GPU for every local rank."""
        if self.runtime.device != "auto":
            return self.runtime.device
        import torch  # lazy: torch stays out of `tessera --help`

        if not torch.cuda.is_available():
            return "cpu"
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.layout.world_size))
        return "cuda" if torch.cuda.device_count() >= local else "cpu"

    def parallel_config(self):
        """The ParallelConfig this config runs, built once per config (a schedule file is read once) and kept
        on it; `dataclasses.replace` makes a new config, which builds its own."""
        built = self.__dict__.get("_parallel_config")
        if built is None:
            built = self._build_parallel_config()
            object.__setattr__(self, "_parallel_config", built)  # a cache, not a field: frozen stays frozen
        return built

    def __getstate__(self) -> dict[str, Any]:
        # the ranks receive the fields only and build the view again (a schedule file is read on every rank)
        return {k: v for k, v in self.__dict__.items() if k not in ("_parallel_config", "_layout")}

    def _build_parallel_config(self):
        # lazy: tessera.parallel imports torch, which stays out of `tessera --help`
        from tessera.parallel import ParallelConfig
        from tessera.parallel.data import DataParallelConfig
        from tessera.parallel.pipeline import PipelineConfig

        p = self.parallel
        data = DataParallelConfig(p.fsdp.upper(), self.mixed_precision, p.ac, p.prefetch)
        if p.schedule_file is not None:  # the file's actions, as data (read here, on every rank, like --data)
            pipeline = PipelineConfig(
                tuple(map(tuple, read_schedule_file(p.schedule_file))),
                self.virtual,
                p.layers_per_stage,
                self.data.microbatches,
                source=f"schedule_file={p.schedule_file}",
            )
        else:
            pipeline = PipelineConfig(p.schedule or "1f1b", self.virtual, p.layers_per_stage, self.data.microbatches)
        return ParallelConfig(
            layout=self.layout,
            sequence_parallel=p.sequence_parallel,
            data=data,
            pipeline=pipeline,
            cp_method=p.cp_method or "ring",
            timeout=self.runtime.timeout,
            compile=p.compile,
            loss=p.loss,
        )

    @property
    def resume_path(self) -> str:
        path = self.checkpoint.resume or self.checkpoint.dir
        if not path:
            raise ValueError("--resume needs a checkpoint path, or --checkpoint-dir DIR to resume from its latest")
        return path

    # ------------------------------------------------------------------ validation
    def check(self, flags: Mapping[str, str] | None = None) -> None:
        """Every input error, raised before any rank starts (ValueError naming the value and the fix). The
        library's checks name their parameters (microbatches=2); here they name `flags` instead (default:
        `tessera train`'s, --microbatches 2; `tessera bench`, whose layouts are names, passes none)."""
        from . import preflight  # lazy: preflight imports torch, which stays out of `tessera --help`

        try:
            check_loggers(self.runtime.tensorboard, self.runtime.wandb)  # a library missing: before anything slow
            preflight.check(self)
        except ValueError as e:  # ConfigError, CheckpointError, and the plain ValueErrors of the library's checks
            message = with_flags(str(e), flag_names() if flags is None else flags)
            if message == str(e) or not (type(e) is ValueError or isinstance(e, TesseraError)):
                raise
            raise type(e)(message) from None


def parser_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """A subcommand's parameters -> its flags: each option's dest -> its long option (--from-hf for from_hf)."""
    return {a.dest: max(a.option_strings, key=len) for a in parser._actions if a.option_strings and a.dest != "help"}


def said(error: BaseException, args: argparse.Namespace) -> str:
    """An error's message as the command line says it: the parameters it names written as the command's flags
    (build_parser leaves each subcommand's in args.flags)."""
    return with_flags(str(error), getattr(args, "flags", {}))


def flag_names() -> dict[str, str]:
    """The parameters library messages name -> the `tessera train` flag that sets them: every field of the
    sections but the checkpoint's, whose short names (dir, every) are no parameter of the library: those by
    the names Config.create takes for them (checkpoint_dir, init_from, init_from_hf, ...); and the library's
    own names of two fields, PipelineConfig's layers_per_stage (--pp-layers) and DataParallelConfig's
    activation_checkpointing (--ac)."""
    out = {f.name: flag_of(f) for name, cls in SECTIONS.items() if name != "checkpoint" for f in fields(cls)}
    for f in fields(SECTIONS["checkpoint"]):
        out[flag_of(f).lstrip("-").replace("-", "_")] = flag_of(f)
    return {**out, "layers_per_stage": "--pp-layers", "activation_checkpointing": "--ac"}


def _flat_names() -> dict[str, tuple[str, str]]:
    """flat name -> (section, field): the field name, and the flag's name (checkpoint_dir, model) too."""
    out: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            out[f.name if section != "checkpoint" else f"checkpoint_{f.name}"] = (section, f.name)
            if f.metadata.get("flag"):
                out[f.metadata["flag"].lstrip("-").replace("-", "_")] = (section, f.name)
    out["init_from"] = ("checkpoint", "init_from")
    out["init_from_hf"] = ("checkpoint", "init_from_hf")
    out["resume"] = ("checkpoint", "resume")
    return out


# ---------------------------------------------------------------------- the command line, from the fields
def flag_of(f: dataclasses.Field) -> str:
    if f.metadata.get("flag"):
        return f.metadata["flag"]
    return "--" + f.name.replace("_", "-")


def _parse_type(f: dataclasses.Field, default: Any):
    kind = type(default) if default is not None else None
    text = str(f.type)
    if kind is int or text.startswith("int"):
        return int
    if kind is float or text.startswith("float"):
        return float
    return str


DEGREE_FLAGS = _axes.FLAGS  # one per axis: pp, dp_replicate, dp (dp_replicate x dp_shard), cp, tp


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; the help text is the field's doc and its default. Degrees default to
    None on the command line so that, under torchrun, the ones not given can be inferred."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in fields(cls):
            default = f.default
            extra = dict(f.metadata.get("argparse", {}))
            help_ = f.metadata["doc"] + ("" if default in (None, False) else f" (default: {default})")
            help_ = help_.replace("%", "%%")  # argparse %-formats help texts ("rank s % pp" broke --help)
            dest = f"{section}.{f.name}"
            if isinstance(default, bool):  # on by default: --no-NAME turns it off
                action = argparse.BooleanOptionalAction if default else "store_true"
                group.add_argument(flag_of(f), dest=dest, action=action, default=default, help=help_)
                continue
            if section == "parallel" and f.name in DEGREE_FLAGS:
                default = None
            kind = _parse_type(f, f.default)
            # a plain metavar (N, RATE, ...), never argparse's own from the dotted dest (PARALLEL.PP, OPTIMIZER.LR)
            extra.setdefault("metavar", {int: "N", float: "X"}.get(kind, "VALUE"))
            group.add_argument(flag_of(f), dest=dest, type=kind, default=default, help=help_, **extra)


def config_from_args(args: argparse.Namespace, world_size: int | None = None) -> Config:
    """Build the Config from parsed flags. Under torchrun (`world_size` given), the degrees not on the
    command line are inferred: the rest of the world goes to dp_shard."""
    values = vars(args)
    parts: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for key, value in values.items():
        if "." in key:
            section, name = key.split(".", 1)
            if section in parts:
                parts[section][name] = value
    degrees = parts["parallel"]
    given = {k: v for k, v in degrees.items() if k in DEGREE_FLAGS and v is not None}
    rest = _axes.AXIS[_axes.rest_axes()[0]]  # dp_shard, whose flag --dp counts dp_replicate x dp_shard
    if world_size is not None and rest.flag not in given:
        for k, v in given.items():
            if v < 1:
                raise ValueError(f"{k}={v} must be a positive integer; use --{k.replace('_', '-')} 1 or more")
        others = [a.flag for a in _axes.TABLE if a.name not in rest.counts and not a.borrows]  # pp, cp, tp
        fixed = math.prod(given.get(k, 1) for k in others)
        if world_size % fixed:
            raise ValueError(
                f"WORLD_SIZE={world_size} is not divisible by {' x '.join(others)} = {fixed}; launch a multiple of "
                f"{fixed} ranks"
            )
        given[rest.flag] = world_size // fixed
    for k in DEGREE_FLAGS:
        degrees[k] = given.get(k, 1)
    return Config(**{s: SECTIONS[s](**kw) for s, kw in parts.items()})

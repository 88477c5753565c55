"""One training configuration: its sections (tessera.training.sections), validated once, before any rank starts.

Every field carries its flag and a one-line doc in its metadata; the `tessera train` command line is
built from these fields (`add_arguments`, here), so defaults are written there and nowhere else. `check()`
raises ValueError naming the value and the fix; `to_dict()` is what the checkpoint manifest and the
metrics header record.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any, Mapping

from tessera.metrics.loggers import check_loggers
from tessera.topology import Layout
from tessera.topology import axes as _axes
from tessera.topology.errors import TesseraError, with_flags
from tessera.topology.schedules.schedule import V_KINDS, fewest_microbatches
from tessera.topology.schedules.schedule_files import read_schedule_file


from .field_types import check_types
from .sections import (  # noqa: F401  (re-exported: tessera.config's names, as before the split)
    ModelSection,
    ParallelSection,
    OptimizerSection,
    DataSection,
    CheckpointSection,
    RuntimeSection,
    FaultToleranceSection,
    opt,
    degree_opt,
    MAX_SKIPPED_STEPS,
    SECTIONS,
    DEGREE_FLAGS,
)


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    ft: FaultToleranceSection = field(default_factory=FaultToleranceSection)
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
    # The derived values are computed once per config and held (functools.cached_property writes the
    # instance's __dict__, not a field: frozen stays frozen, to_dict() and the manifest omit them);
    # `dataclasses.replace` makes a new config, which computes its own.
    @cached_property
    def layout(self) -> Layout:
        """The mesh shape this config runs (its degrees and batch are frozen)."""
        return self.parallel.layout_for(self.data.global_batch)

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

    @cached_property
    def model_config(self) -> Any:
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

    def parallel_config(self) -> Any:
        """The ParallelConfig this config runs, built once per config (a schedule file is read once)."""
        return self._parallel_config

    def __getstate__(self) -> dict[str, Any]:
        # the ranks receive the fields only and compute the derived values again (a schedule file, a
        # config.json are read on every rank)
        derived = {name for name, value in vars(Config).items() if isinstance(value, cached_property)}
        return {k: v for k, v in self.__dict__.items() if k not in derived}

    @cached_property
    def _parallel_config(self) -> Any:
        # lazy: tessera.parallel imports torch, which stays out of `tessera --help`
        from tessera.parallel import ParallelConfig
        from tessera.parallel.fsdp import DataParallelConfig
        from tessera.parallel.pipeline import PipelineConfig

        p = self.parallel
        data = DataParallelConfig(p.fsdp.upper(), self.mixed_precision, p.ac, p.prefetch, p.offload)
        if p.schedule_file is not None:  # the file's actions, as data (read here, on every rank, like --data)
            pipeline = PipelineConfig(
                tuple(map(tuple, read_schedule_file(p.schedule_file))),
                self.virtual,
                p.layers_per_stage,
                self.microbatches,
                source=f"schedule_file={p.schedule_file}",
            )
        else:
            pipeline = PipelineConfig(p.schedule or "1f1b", self.virtual, p.layers_per_stage, self.microbatches)
        return ParallelConfig(
            layout=self.layout,
            sequence_parallel=p.sequence_parallel,
            data=data,
            pipeline=pipeline,
            cp_method=p.cp_method or "ring",
            timeout=self.runtime.timeout,
            compile=p.compile,
            loss=p.loss,
            fp8=p.fp8,
        )

    @property
    def resume_path(self) -> str:
        path = self.checkpoint.resume or self.checkpoint.dir
        if not path:
            raise ValueError("--resume needs a checkpoint path, or --checkpoint-dir DIR to resume from its latest")
        return path

    # ------------------------------------------------------------------ validation
    def check(self, flags: Mapping[str, str] | None = None) -> None:
        """Every input error, raised before any rank starts (ValueError naming the value and the fix): one pass
        over the sections, each check given the sections it reads (tessera.training.preflight). The library's
        checks name their parameters (microbatches=2); here they name `flags` instead (default: `tessera
        train`'s, --microbatches 2; `tessera bench`, whose layouts are names, passes none). Checks that only a
        rank can make (its device, its mesh) stay on the rank."""
        try:
            check_loggers(self.runtime.tensorboard, self.runtime.wandb)  # a library missing: before anything slow
            self._check_sections()
        except ValueError as e:  # ConfigError, CheckpointError, and the plain ValueErrors of the library's checks
            message = with_flags(str(e), flag_names() if flags is None else flags)
            if message == str(e) or not (type(e) is ValueError or isinstance(e, TesseraError)):
                raise
            raise type(e)(message) from None

    def _check_sections(self) -> None:
        from . import preflight  # lazy: preflight imports torch, which stays out of `tessera --help`

        m, p, o, d, c, r, ft = (
            self.model,
            self.parallel,
            self.optimizer,
            self.data,
            self.checkpoint,
            self.runtime,
            self.ft,
        )
        check_types(m, p, o, d, c, r, ft)  # before anything reads a value of the wrong type
        preflight.check_launched_world(self.layout, ft)
        preflight.check_numbers(d, o, r, c)
        preflight.check_drift_flag(r, c, d)
        preflight.check_model_flags(m)
        model = self.model_config  # an unknown preset: a ValueError naming the presets
        preflight.check_seq_len(d, m.preset, model)
        preflight.check_optimizer(o, model)
        layout = self.layout  # degrees, dp_replicate vs dp
        preflight.check_pipeline_flags(p)  # and --cp-method without --cp
        self.parallel_config().check(model, d.seq_len, d.global_batch, d.microbatches)
        device_type = self.device_type()
        preflight.check_device(r, p, device_type, layout.world_size)
        preflight.check_precision(p, model, layout.tp, device_type)
        preflight.check_offload(p, o)
        preflight.check_fault_tolerance(ft, p, o)
        preflight.check_fits(self, layout.world_size)
        resume = self.resume_path if c.resume is not None else None
        preflight.check_paths(r, c, resume, self.model_name, model, d, o)
        preflight.check_measuring_flags(r, resume)
        preflight.check_data(d, m, self.model_name, model, resume)


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

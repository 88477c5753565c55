"""torchtitan as the peer of a tessera row: its own trainer, model, parallelize and config, given a model of a
tessera preset's dimensions and synthetic tokens, so that the two train the same shapes side by side.

torchtitan 0.2.2, the last release that runs on torch 2.11 (the GPU machines'): 0.3.0 imports
`torch.distributed.fsdp.DataParallelMeshDims`, which torch 2.11 lacks. Its trainer imports this module through
`--experimental.custom_import peer_torchtitan` (benchmarks/ on the path), which registers the train spec
`tessera_llama3`: torchtitan's llama3 Transformer and every builder of torchtitan's llama3 spec (parallelize,
optimizer, schedule, loss, validator), except the tokenizer and the data. Those read no files: a tokenizer that
knows only the vocabulary's size, and seeded uniform tokens in torchtitan's own batch format ({"input": x},
labels), as tessera's synthetic data are. What torchtitan measures is its own `tps` (tokens per second per
device over the steps since its last log line), read back from its log (`parse_steps`).

    python -m torchtitan.train $(python -c "import peer_torchtitan as p; print(' '.join(p.command_args(...)))")
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.llama3 import Transformer, TransformerModelArgs, get_train_spec
from torchtitan.protocols.train_spec import _extra_train_specs, register_train_spec

from tessera.models import get_preset

SPEC_NAME = "tessera_llama3"
PRESETS = ("1b", "debug")  # tessera's llama presets the peer builds (a flavor each)
DATA_SEED = 1234
# torchtitan's per-step log line (components/metrics.py): "step: 3  loss: 10.9  ...  memory: 41.2GiB(29.5%)
# tps: 61,234  tflops: 389.1  mfu: 39.3%", colour codes between the fields
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+0-9.eE]+|nan|inf)\s+grad_norm:\s*(?P<grad_norm>[-+0-9.eE]+|nan|inf).*?memory:\s*(?P<gib>[0-9.]+)GiB.*?"
    r"tps:\s*(?P<tps>[0-9,]+)"
)


def model_args(preset: str) -> TransformerModelArgs:
    """torchtitan's llama3 arguments at a tessera preset's dimensions. torchtitan derives the MLP width from
    `multiple_of` (int(8 dim / 3) rounded up to it): the preset's ffn_dim as that multiple gives it exactly."""
    c = get_preset(preset)
    if int(8 * c.dim / 3) > c.ffn_dim:
        raise ValueError(f"preset {preset}: ffn_dim {c.ffn_dim} is below 8 dim / 3, which torchtitan cannot build")
    return TransformerModelArgs(
        dim=c.dim,
        n_layers=c.n_layers,
        n_heads=c.n_heads,
        n_kv_heads=c.n_kv_heads,
        vocab_size=c.vocab_size,
        multiple_of=c.ffn_dim,
        ffn_dim_multiplier=None,
        norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
    )


class VocabularyTokenizer(BaseTokenizer):
    """A tokenizer that only knows its vocabulary's size: the synthetic data need no text."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.eos_id = 0

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("the peer trains on synthetic tokens: nothing to encode")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("the peer trains on synthetic tokens: nothing to decode")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SyntheticTokens(IterableDataset):
    """Seeded uniform tokens, one sequence at a time, in torchtitan's format: ({"input": x[:-1]}, x[1:])."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.sample = 0

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed)
        while True:
            x = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen)
            self.sample += 1
            yield {"input": x[:-1]}, x[1:]

    def state_dict(self) -> dict[str, int]:
        return {"sample": self.sample}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sample = state["sample"]


def build_tokenizer(job_config: Any) -> VocabularyTokenizer:
    return VocabularyTokenizer(model_args(job_config.model.flavor).vocab_size)


def build_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any, infinite: bool = True
) -> ParallelAwareDataloader:
    data = SyntheticTokens(tokenizer.get_vocab_size(), job_config.training.seq_len, DATA_SEED + dp_rank)
    return ParallelAwareDataloader(
        data, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=job_config.training.local_batch_size
    )


def register() -> None:
    """The train spec `tessera_llama3`: torchtitan's llama3 spec with tessera's presets as flavors and the
    synthetic tokenizer and data (once a process)."""
    if SPEC_NAME in _extra_train_specs:
        return
    base = get_train_spec()
    base.model_args = {p: model_args(p) for p in PRESETS}
    base.build_tokenizer_fn = build_tokenizer
    base.build_dataloader_fn = build_dataloader
    base.build_validator_fn = None
    register_train_spec(SPEC_NAME, base)


@dataclass(frozen=True)
class PeerRow:
    """One torchtitan run: a tessera preset at a batch and sequence, compiled or eager, bf16 or FP8."""

    preset: str
    batch: int
    seq_len: int
    steps: int
    compile: bool
    fp8: str | None = None  # torchtitan's float8 recipe: "rowwise" (it dropped tensorwise's default use)
    ac: str = "none"
    emulate: bool = False  # torchao's float8 emulated, tensorwise (the CPU checks), not the hardware's


def cpu_row(preset: str, batch: int, seq_len: int, steps: int, fp8: str | None) -> PeerRow:
    """The row a CPU runs for `fp8`'s: eager, and an FP8 row in the tensorwise form torchtitan emulates (its
    recipes by name are never emulated: command_args)."""
    form = fp8 and "tensorwise"
    return PeerRow(preset, batch, seq_len, steps, compile=False, fp8=form, emulate=form is not None)


def command_args(row: PeerRow, dump_folder: str) -> list[str]:
    """torchtitan.train's arguments for `row`: tessera's defaults where torchtitan's differ (no activation
    checkpointing, a log line every step, no checkpoint or validation), the output head left in bf16 under FP8
    as tessera leaves it."""
    args = [
        "--experimental.custom_import",
        "peer_torchtitan",
        "--model.name",
        SPEC_NAME,
        "--model.flavor",
        row.preset,
        "--training.local_batch_size",
        str(row.batch),
        "--training.seq_len",
        str(row.seq_len),
        "--training.steps",
        str(row.steps),
        "--training.mixed_precision_param",
        "bfloat16",
        "--activation_checkpoint.mode",
        row.ac,
        "--metrics.log_freq",
        "1",
        "--metrics.disable_color_printing",
        "--lr_scheduler.warmup_steps",
        "1",
        "--job.dump_folder",
        dump_folder,
        "--model.hf_assets_path",
        dump_folder,  # read by nothing here (no tokenizer files, no checkpoint); an existing folder for its check
    ]
    if row.compile:
        args += ["--compile.enable", "--compile.components", "model,loss"]
    if row.fp8:
        args += ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.filter_fqns", "output"]
        if row.emulate:  # torchtitan builds a recipe by its name alone, never emulated: the CPU runs the
            # emulated tensorwise form (no recipe name), as CPU _scaled_mm scales per tensor only
            if row.fp8 != "tensorwise":
                raise ValueError(f"torchtitan emulates float8 tensorwise only, not {row.fp8}")
            args.append("--quantize.linear.float8.emulate")
        else:
            args += ["--quantize.linear.float8.recipe_name", row.fp8]
    return args


def parse_steps(log: str) -> list[dict[str, float]]:
    """Each step torchtitan logged: its number, loss, reserved memory (GiB) and tokens per second per device."""
    out = []
    for line in _ANSI.sub("", log).splitlines():
        m = _STEP.search(line)
        if m:
            out.append(
                dict(
                    step=int(m["step"]),
                    loss=float(m["loss"]),
                    grad_norm=float(m["grad_norm"]),
                    memory_gib=float(m["gib"]),
                    tps=float(m["tps"].replace(",", "")),
                )
            )
    return out


def job_view(preset: str, batch: int, seq_len: int) -> Any:
    """The fields of torchtitan's JobConfig the peer's builders read, for a call outside its trainer."""
    from types import SimpleNamespace  # lazy: only the checks build one

    return SimpleNamespace(
        model=SimpleNamespace(flavor=preset), training=SimpleNamespace(local_batch_size=batch, seq_len=seq_len)
    )


def build_model(preset: str, device: str = "meta") -> Transformer:
    """torchtitan's Transformer at a preset's dimensions (on the meta device unless told)."""
    with torch.device(device):
        return Transformer(model_args(preset))


register()

"""The sections of a training configuration: nested frozen dataclasses whose fields carry their flag and a
one-line doc in their metadata (`opt`), so that `tessera train`'s command line is built from them
(tessera.training.run_config.add_arguments) and defaults are written here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera.topology import Layout
from tessera.topology import axes as _axes


DEGREE_FLAGS = _axes.FLAGS  # one per axis: pp, dp_replicate, dp (dp_replicate x dp_shard), cp, tp


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
        "model preset of a registered family: llama (debug, small, 1b, 8b, 70b, 405b), qwen3 (qwen3-debug, "
        "qwen3-0.6b, qwen3-1.7b, qwen3-8b), qwen3_moe (qwen3-moe-debug, qwen3-moe-shared-debug, qwen3-30b-a3b, "
        "qwen3-235b-a22b), deepseek_v3 (deepseek-v3-debug, deepseek-v3-lite, deepseek-v3-671b), gpt_oss "
        "(gpt-oss-debug, gpt-oss-20b, gpt-oss-120b); or hf:DIR (a Hugging Face config.json, the family from its "
        "model_type)",
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
    fp8: str | None = opt(
        None,
        "FP8 matmuls (torchao float8) on the linear layers: tensorwise or rowwise scaling; the head, router, "
        "experts and layers whose dims are not multiples of 16 stay in --mixed-precision; emulated on CPU",
        metavar="tensorwise|rowwise",
    )
    prefetch: int = opt(0, "explicit FSDP all-gather prefetch of N blocks (0: FSDP2's implicit prefetch)", metavar="N")
    offload: str = opt(
        "none",
        "model states in host memory: optimizer (AdamW's moments and an fp32 copy of each shard, stepped on the "
        "host; weights and gradients stay on the GPU) or params (FSDP2's CPUOffloadPolicy: parameter shards, "
        "gradients and optimizer state on the host); the price is PCIe copies and a host-side step",
        metavar="none|optimizer|params",
    )
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
        from tessera.parallel.fsdp import layout_for_strategy  # lazy: torch stays out of `tessera --help`

        flags = {name: getattr(self, name) for name in DEGREE_FLAGS}
        layout = Layout(**_axes.degrees_from_flags(flags, global_batch=global_batch))
        if self.fsdp.upper() == "NO_SHARD" and 1 < layout.dp_replicate < layout.dp:
            # NO_SHARD replicates over every dp rank: the replica groups asked for would do nothing
            raise ValueError(
                f"fsdp=NO_SHARD replicates over all dp={layout.dp} ranks, so dp_replicate={layout.dp_replicate} "
                f"would do nothing (it ran as dp_replicate={layout.dp}): drop dp_replicate, or use "
                f"fsdp=HYBRID_SHARD to shard within its replica groups"
            )
        return layout_for_strategy(layout, self.fsdp.upper())


@dataclass(frozen=True)
class OptimizerSection:
    optimizer: str = opt(
        "adamw",
        "adamw, or muon: Muon on the model spec's hidden weight matrices (attention, MLP, experts), AdamW on the "
        "rest (embeddings, head, norms, routers); docs/training.md#muon---optimizer-muon",
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
    eval_data: str | None = opt(
        None, "held-out data for --eval-every: token files or hf:PATH[:split] (same forms as --data)", metavar="PATH"
    )
    eval_every: int = opt(
        0, "every N steps, the mean loss on --eval-batches global batches of --eval-data (0: never)", metavar="N"
    )
    eval_batches: int = opt(1, "global batches of --eval-data per evaluation (the same ones each time)", metavar="K")
    path: str | None = opt(
        None,
        "token files (a .bin shard with its .json, or a directory of them) from `tessera "
        "tokenize`, or hf:PATH[:split]: a data set the datasets library reads from local JSONL, Parquet, Arrow "
        "or save_to_disk files, streamed and tokenized with --tokenizer; default: the text shipped with tessera, "
        "byte-tokenized",
        flag="--data",
        metavar="PATH",
    )
    tokenizer: str | None = opt(
        None,
        "hf: data: a tokenizer.json, or a Hugging Face model folder holding one (its chat template is --sft's)",
        metavar="PATH",
    )
    text_field: str = opt("text", "hf: data: the records' field holding each document's text", metavar="NAME")
    sft: bool = opt(
        False,
        "hf: data: supervised fine-tuning on records with 'messages' (role and content) or 'prompt' and "
        "'response', rendered with the tokenizer's chat template (else a plain one, docs/data.md); the loss "
        "counts the assistant's tokens only",
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
    every: int = opt(0, "save every N steps and the last (0: never)", flag="--checkpoint-every", metavar="N")
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
        "attention, RMSNorm and the chunked loss's softmax: auto (on CUDA the Triton kernels, but on Hopper "
        "or newer cuDNN's attention for 16-bit causal or full attention without packed documents, window or "
        "sinks, head dim <= 128: its backward is not bitwise repeatable; torch's fused ops on CPU), torch or "
        "triton (every one in Triton, deterministic)",
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


@dataclass(frozen=True)
class FaultToleranceSection:
    fault_tolerant: bool = opt(
        False,
        "the replicate axis fault-tolerant (torchft, the ft extra): each of the --dp-replicate replica groups its "
        "own set of ranks; a group that dies leaves the others training, a restarted one rejoins with its peers' "
        "live state (outside torchrun the local launcher starts a lighthouse and every group)",
    )
    ft_replica_id: int | None = opt(
        None,
        "this replica group's id, 0..R-1 (under torchrun, one job per group; else the launcher sets it)",
        metavar="R",
    )
    lighthouse: str | None = opt(
        None,
        "the torchft lighthouse's address, http://HOST:PORT (tessera lighthouse; else the launcher's)",
        metavar="ADDR",
    )
    ft_timeout: float = opt(
        30.0, "seconds a step may wait for its quorum or a collective between replica groups", metavar="SECONDS"
    )
    ft_min_replicas: int = opt(1, "the fewest replica groups a step may commit with", metavar="N")
    ft_replica_groups: int = opt(
        0,
        "set by tessera itself: the replica groups (the whole run's --dp-replicate) of a group's own config, whose "
        "layout has none (0: not a group's config)",
        metavar="R",
    )
    ft_replacements: int = opt(
        1,
        "the local launcher: start a replacement for a dead replica group up to N times (it rejoins at a step "
        "boundary with its peers' state, over the network)",
        metavar="N",
    )


SECTIONS = {
    "model": ModelSection,
    "parallel": ParallelSection,
    "optimizer": OptimizerSection,
    "data": DataSection,
    "checkpoint": CheckpointSection,
    "runtime": RuntimeSection,
    "ft": FaultToleranceSection,
}

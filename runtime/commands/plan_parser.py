"""`tessera plan`'s flags: the model, the machine (a hardware profile and the loose flags that override one
of its figures), the job, the layout to score alone, the search's options and --calibrate's."""

from __future__ import annotations


from tessera.topology.hardware import (
    ATTENTION_BACKENDS,
    DEFAULT_PROFILE,
    profile_names,
)
from tessera.topology.estimators.plan_inputs import AC_POLICIES, TESSERA_EFFICIENCY


from .plan import run_plan


def add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="ranked layouts for a model on N GPUs, with the per-rank memory breakdown",
        description="Enumerate every layout tessera can run (tp inside a node, cp, pp with its schedule, "
        "microbatches and virtual stages, dp_replicate x dp_shard, FSDP strategy, activation "
        "checkpointing), estimate per-rank memory and step time, rule out what does not fit and "
        "rank the rest. Estimates, not measurements: the assumptions are the options below.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="a model preset of any registered family (debug, small, 1b, 8b, 70b, 405b, qwen3-0.6b, ...), or hf:DIR "
        "(a Hugging Face config.json of a family tessera describes: dense or MoE, GQA or MHA, tied or not)",
    )
    p.add_argument("--gpus", type=int, default=None, help="GPUs in the job (required unless --calibrate)")
    p.add_argument(
        "--hardware",
        default=DEFAULT_PROFILE,
        metavar="NAME|FILE",
        help=f"the machine: a profile of topology/hardware_profiles.json ({', '.join(profile_names())}) or a JSON "
        f"file of that shape (default {DEFAULT_PROFILE}); the flags below override one figure of it",
    )
    p.add_argument("--gpu-memory", type=float, default=None, help="GB per GPU (default: the profile's HBM)")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="the optimizer whose state is counted (muon: one momentum on the matrices, AdamW's two moments on "
        "the rest, and the matrix an owner gathers whole at the step); the printed train commands use it",
    )
    p.add_argument(
        "--gpus-per-node", type=int, default=None, help="GPUs per node; tp stays inside one (default: the profile's)"
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (required unless --calibrate: default 1024)"
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step (required unless --calibrate; there: the rows measured, default 1)",
    )
    p.add_argument(
        "--top",
        type=int,
        default=10,
        help="layouts to show (default 10); 0 with --layout scores that layout alone, without ranking the others",
    )
    p.add_argument(
        "--layout",
        default=None,
        metavar="LAYOUT",
        help="also score this layout (tessera bench's names: pp2xdp4xtp8, dpr2xdp4xtp2+sp, with +ac_op, "
        "+ac_full, +ac_selective or +zero2 to fix a setting, +compile, +async_tp to plan the tp collectives "
        "overlapped with the matmuls as torchtitan's and Megatron's are, +ep_overlap the expert all-to-alls beside "
        "another microbatch's compute as Megatron's, +ep_over_tp an expert group of ep x tp ranks holding "
        "whole experts as Megatron's MoE parallel folding (its TP 2 EP 32 is tp2xep16+sp+ep_over_tp)): its rank, "
        "and why it is slower or does not fit; its estimate "
        "under layout.estimate in --json",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="with --layout: the gradient-accumulation steps (pipeline microbatches) it runs (default: the planner's)",
    )
    p.add_argument("--schedule", default=None, help="with --layout and pp > 1: the pipeline schedule it runs")
    p.add_argument("--virtual", type=int, default=None, help="with --layout and pp > 1: the stages per pp rank")
    p.add_argument(
        "--compile", action="store_true", help="plan compiled blocks (the elementwise work fused, as measured)"
    )
    p.add_argument(
        "--ac-policy",
        choices=AC_POLICIES,
        default="tessera",
        help="whose per-op checkpointing --ac op (+ac_op) counts: tessera's (every matmul output kept, the default) or "
        "torchtitan's per-op SAC (every other matmul's output kept, the rest recomputed): to predict a torchtitan run",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTION_BACKENDS,
        default="cudnn",
        help="the attention kernels' backend whose rate is planned (default cudnn, what tessera picks on Hopper; "
        "flash2: SDPA's default FlashAttention-2)",
    )
    p.add_argument(
        "--offload",
        choices=("none", "optimizer", "params"),
        default=None,
        help="plan tessera train --offload: optimizer (AdamW's moments and an fp32 copy on the host, stepped there) "
        "or params (FSDP2's CPUOffloadPolicy); its PCIe copies and host step are counted, the host memory per node "
        "checked (default: offload only where nothing fits without it)",
    )
    p.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="plan tessera train --fault-tolerant: the replicate axis's all-reduce through torchft after the "
        "backward (exposed, with the quorum's round trips) and its gradient buffer (8 B a local parameter)",
    )
    p.add_argument("--json", action="store_true", help="print the ranked layouts as JSON")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build the top layout on the fake backend (model on meta) and count each rank's parameters exactly",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        metavar="TFLOPS",
        help="dense bf16 peak per GPU, which MFU is measured against (default: the profile's; with --device-kind "
        "none, and no MFU is shown unless it is given)",
    )
    p.add_argument(
        "--efficiency",
        type=float,
        default=None,
        metavar="SHARE",
        help=f"the framework's software efficiency, in (0, 1]: the share of the kernels' rates (the profile's "
        f"achieved shares) a step reaches (default {TESSERA_EFFICIENCY:g}, tessera's, fitted on the lent H200)",
    )
    p.add_argument(
        "--intra-node-gbps",
        type=float,
        default=None,
        help="GB/s per GPU reached inside a node (default: the profile's NVLink at its achieved link share)",
    )
    p.add_argument(
        "--inter-node-gbps",
        type=float,
        default=None,
        help="GB/s per GPU reached across nodes (default: the profile's network at its achieved link share)",
    )
    p.add_argument(
        "--hbm-gbps",
        type=float,
        default=None,
        help="GB/s reached of a GPU's own memory (default: the profile's HBM at its achieved share)",
    )
    p.add_argument(
        "--fp8",
        default=None,
        metavar="tensorwise|rowwise",
        help="plan for tessera train --fp8: the linear layers' matmuls at 2x the bf16 rate (the datasheet's "
        "ratio until a GPU calibrates FP8), their casts' memory traffic, tensorwise's float8 all-gather",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=0.10,
        help="share of GPU memory kept free for the CUDA context, NCCL and fragmentation (default 0.10)",
    )
    cal = p.add_argument_group(
        "calibration",
        "Measured rates instead of --peak-tflops x --efficiency: --calibrate measures this machine (a "
        "matmul at the model's shapes in the compute dtype, tessera's attention, the bandwidth a block's "
        "elementwise operators reach beside a plain copy, the host's "
        "cost per operator) and stores the figures by device kind; --device-kind plans with a stored kind "
        "(topology/estimators/step_time.py states what the step-time model counts)",
    )
    cal.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this device at --model's shapes (--seq-len x --global-batch tokens) and store the figures",
    )
    cal.add_argument(
        "--calibration",
        default=None,
        metavar="PATH",
        help="the calibration file (default $TESSERA_CALIBRATION or ~/.cache/tessera/calibration.json)",
    )
    cal.add_argument(
        "--device-kind",
        default=None,
        metavar="KIND",
        help="plan with the stored calibration whose device kind contains KIND (e.g. H100, cpu)",
    )
    cal.add_argument(
        "--calibration-overlay",
        default=None,
        metavar="KIND",
        help="take the shares of --hardware's peaks that a step reaches from the stored calibration of a GPU of "
        "kind KIND (its measured matmul, attention and memory rates), keeping the profile's model of the step",
    )
    cal.add_argument(
        "--mixed-precision",
        choices=("bf16", "fp32"),
        default=None,
        help="--calibrate: the compute dtype to measure (default bf16 on CUDA, fp32 on CPU)",
    )
    cal.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="--calibrate: the device to measure"
    )
    cal.add_argument(
        "--threads", type=int, default=1, help="--calibrate on CPU: threads (default 1, as one tessera rank runs)"
    )
    cal.add_argument("--quick", action="store_true", help="--calibrate: smaller measurements (a few seconds on a CPU)")
    p.set_defaults(func=run_plan, flags={"gpu_memory_gb": "--gpu-memory"})  # Hardware's name for --gpu-memory

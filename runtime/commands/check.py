"""`tessera check`: prove a layout equal to one process at its real world size, every rank simulated in this
one process (tessera.testing.prove_layout, runtime/testing/simulated_world.py); one verdict line ends it."""

from __future__ import annotations

import argparse
import json
import sys

from tessera.testing.simulated_world import FP8_RECIPES, MAX_STEPS, OPTIMIZERS, prove_layout
from tessera.training.run_config import said


def add_check_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="prove a layout equal to one process at its real world size, every rank simulated in this process",
    )
    p.add_argument("--layout", required=True, help="the layout, as tessera bench names it (e.g. dp32xtp8+sp)")
    p.add_argument("--world", type=int, help="the world size to simulate (default: the layout's; it must be that)")
    p.add_argument(
        "--model",
        help="a llama-family or MoE preset (default: the debug model, or the MoE debug model under ep, sized for the "
        "layout's tp, pp and ep; widths the FSDP ranks do not split run as FSDP2 shards them, padded)",
    )
    p.add_argument("--steps", type=int, default=2, help=f"training steps to compare (default 2, at most {MAX_STEPS})")
    p.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sequence (default: 32, or the least above it the layout splits: 2 x cp chunks, each "
        "rank's share over tp under sequence parallel)",
    )
    p.add_argument("--global-batch", type=int, help="sequences per step (default: 2 per data-parallel rank)")
    p.add_argument(
        "--fp8",
        choices=FP8_RECIPES,
        help="train both sides in FP8 (torchao's float8, emulated on the CPU) and hold the layout to the FP8 "
        "contract: within 2 E of one-process FP8, E one process's own FP8 error",
    )
    p.add_argument(
        "--fsdp",
        metavar="STRATEGY",
        help="the data axis's FSDP2 strategy, as tessera train takes it: FULL_SHARD (default), SHARD_GRAD_OP, "
        "NO_SHARD or HYBRID_SHARD",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="the optimizer both sides train with, as tessera train takes it (muon: Muon on the hidden matrices)",
    )
    p.add_argument(
        "--cp-method",
        choices=("ring", "allgather"),
        help="a cp layout's attention, as tessera train takes it: ring (default) or allgather",
    )
    p.add_argument(
        "--schedule",
        help="a pp layout's pipeline schedule, as tessera train takes it (default 1f1b; every kind runs)",
    )
    p.add_argument("--virtual", type=int, help="a pp layout's virtual stages per pp rank, as tessera train takes it")
    p.add_argument(
        "--microbatches",
        type=int,
        help="a pp layout's microbatches per step (default: the fewest its schedule needs); one process trains "
        "the step's rows in one pass",
    )
    p.add_argument("--json", action="store_true", help="print the record, verdict included, as one JSON object")
    p.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    """0 with the verdict when the layout equals one process, 1 naming what differs, 2 for input it refuses."""
    from tessera.testing.equivalence import LayoutsDiverge  # lazy: torch

    try:
        record = prove_layout(
            args.layout,
            args.world,
            args.model,
            args.steps,
            args.seq_len,
            args.global_batch,
            fp8=args.fp8,
            schedule=args.schedule,
            virtual=args.virtual,
            microbatches=args.microbatches,
            fsdp=args.fsdp,
            optimizer=args.optimizer,
            cp_method=args.cp_method,
        )
    except LayoutsDiverge as e:
        record = getattr(e, "record", {"verdict": f"differs from one process: {e}"})
        print(json.dumps(record) if args.json else f"tessera check: {record['verdict']}")
        return 1
    except ValueError as e:
        print(f"tessera check: error: {said(e, args)}", file=sys.stderr)
        return 2
    print(json.dumps(record) if args.json else record["verdict"])
    return 0

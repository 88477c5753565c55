"""The `tessera` command: train, memory, check, plan, bench, export, convert, tokenize, generate, lighthouse (and
--version)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
import threading
import warnings
from typing import NoReturn

from tessera import __version__
from tessera.topology.errors import TesseraWarning, with_flags
from tessera.training.run_config import add_arguments, config_from_args, flag_names, parser_flags, said
from tessera.launching.rank_server import collector_paused, start_rank_server, under_torchrun

from .bench import add_bench_parser
from .check import add_check_parser
from .export import add_export_parsers
from .generate import add_generate_parser
from .lighthouse import add_lighthouse_parser
from .memory_report import add_memory_parser
from .plan_parser import add_plan_parser
from .plot import add_plot_parser


def _tokenize(args: argparse.Namespace) -> int:
    from .tokenize import tokenize  # lazy: it imports torch (tessera.data.tokens)

    try:
        written = tokenize(
            args.tokenizer, args.out, args.files, args.separator, args.field, args.shard_tokens, progress=not args.quiet
        )
    except (ValueError, OSError) as e:
        print(f"tessera tokenize: error: {said(e, args)}", file=sys.stderr)
        return 2
    from tessera.data.tokens import open_dataset  # lazy: tessera.models imports torch

    total = sum(len(s.tokens) for s in open_dataset(args.out))
    print(f"wrote {len(written)} shard(s), {total:,} tokens, to {args.out}: train on them with --data {args.out}")
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors as tessera's: one line naming the flag, the value and the fix (argparse printed the
    whole usage first: 31 lines for `tessera train --optimizer sgd`, where --fp8's error was one)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="tessera", description="4D-parallel transformer training on one DeviceMesh")
    parser.add_argument("--version", action="version", version=f"tessera {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    add_memory_parser(sub)
    add_check_parser(sub)
    add_export_parsers(sub)
    add_lighthouse_parser(sub)

    tok = sub.add_parser("tokenize", help="text or JSONL files to token files for --data (needs the data extra)")
    tok.add_argument("files", nargs="+", help=".txt files (one document each) or .jsonl files (one per line)")
    tok.add_argument(
        "--tokenizer", required=True, help="a tokenizer.json (Hugging Face tokenizers format); nothing is downloaded"
    )
    tok.add_argument("--out", required=True, help="the directory to write shard_NNNNN.bin/.json into")
    tok.add_argument(
        "--separator", default=None, help="the document separator token (default: the tokenizer's end-of-text token)"
    )
    tok.add_argument("--field", default="text", help="the JSONL field that holds the text (default: text)")
    tok.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default: 100,000,000)")
    tok.add_argument("--quiet", action="store_true", help="no progress bar")
    tok.set_defaults(func=_tokenize)

    add_plan_parser(sub)
    add_bench_parser(sub)
    add_plot_parser(sub)
    add_generate_parser(sub)

    tr = sub.add_parser(
        "train",
        help="train a model on a layout (spawns local ranks outside torchrun)",
        description="Train on a layout. Outside torchrun it spawns pp*dp*cp*tp local ranks (NCCL, one GPU per "
        "rank, on a machine with enough GPUs; gloo on CPU); under torchrun it joins the job, and the "
        "degrees not given are inferred from WORLD_SIZE (the rest to dp).",
    )
    add_arguments(tr)
    tr.set_defaults(func=_train)
    # each subcommand's parameters -> its flags, for the errors it prints (train: the config's fields too; a
    # subcommand may add the library's own names of its options, as plan does Hardware's gpu_memory_gb)
    for name, subparser in sub.choices.items():
        own = subparser.get_default("flags") or {}
        subparser.set_defaults(flags={**parser_flags(subparser), **own, **(flag_names() if name == "train" else {})})
    return parser


def _train(args: argparse.Namespace) -> int:
    if not under_torchrun():
        # the ranks' server imports torch and tessera beside the imports below (and inductor, for --compile; a
        # config file's compile the ranks import themselves)
        start_rank_server(compiles=bool(vars(args).get("parallel.compile")))
    with collector_paused():
        # lazy: these import torch, which stays out of `tessera --help` and the torch-free commands
        from tessera.checkpointing.checkpoint import CheckpointError
        from tessera.launching.launch import Interrupted, RankFailure
        from tessera.training.report import refusal_exit
        from tessera.training.replicas import group_config
        from tessera.training.run import done_line, error_exit, failed_message, stopped_message, train

    try:
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else None
        config = config_from_args(args, world)
        config.check()
        if world is not None:  # a fault-tolerant run's torchrun job is one replica group
            job = group_config(config) if config.ft.fault_tolerant else config
            job.layout.check_world_size(world)
            if config.runtime.check_drift:
                raise ValueError(
                    "--check-drift trains one-process runs after this one: run it outside torchrun "
                    "(tessera train spawns the ranks), or check a torchrun job's records with "
                    "tessera.testing.judge_drift"
                )
    except ValueError as e:  # CheckpointError included
        return refusal_exit("train", said(e, args))
    try:
        history = train(config)
    except CheckpointError as e:  # raised before any rank starts (e.g. the checkpoint directory is in use)
        return refusal_exit("train", said(e, args))
    except (Interrupted, KeyboardInterrupt) as e:  # SIGTERM / Ctrl-C: every rank has been stopped
        why = str(e) or "stopped by SIGINT"
        error_exit("train", stopped_message(why, config))
        return 128 + (15 if "SIGTERM" in why else 2)
    except RankFailure as e:  # a rank's named failure (one of tessera's errors) becomes the command's one line
        if e.cause is not None and e.cause["tessera"]:
            error_exit("train", with_flags(e.cause["message"], args.flags))
            return e.cause["exit_code"]
        if e.cause is None or e.cause["type"] == "OutOfMemoryError":  # killed, or out of GPU memory: no bug
            error_exit("train", failed_message(e, config))
            return 1
        raise  # an unexpected exception in a rank: its traceback is the report
    if history and not config.runtime.quiet:
        print(done_line(history, config))
    if history and config.runtime.check_drift:
        return _check_drift(config, history)
    return 0


def _check_drift(config, history: list) -> int:
    """--check-drift: one process's own spread over microbatch counts, and this run judged against it."""
    from tessera.testing import drift_envelope, judge_drift  # lazy: tessera.testing imports torch

    counts = tuple(m for m in (1, 2, 4) if config.data.global_batch % m == 0)
    envelope = drift_envelope(config, counts)
    problems = judge_drift(history, envelope)
    widest = {k: max(row[k] for row in envelope["envelope"]) for k in ("loss", "grad_norm")}
    spread = (
        f"one process at microbatches {', '.join(map(str, counts))} spreads up to {widest['loss']:.1e} in loss "
        f"and {widest['grad_norm']:.1e} in grad norm"
    )
    if not problems:
        print(f"drift check: all {len(history)} steps within 2x one process's own spread ({spread})")
        return 0
    for line in problems:
        print(f"drift check: {line}")
    print(f"drift check: {len(problems)} of {2 * len(history)} figures beyond 2x one process's own spread ({spread})")
    return 1


def _one_line_warnings() -> None:
    """tessera's own warnings (TesseraWarning) as the CLI prints its errors, one `tessera: warning:` line, not
    Python's two naming a source line; every other warning as Python shows it."""
    shown = warnings.showwarning
    if getattr(shown, "tessera_one_line", False):  # installed already (main called again in one process)
        return

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - warnings' signature
        if issubclass(category, TesseraWarning):
            print(f"tessera: warning: {message}", file=sys.stderr if file is None else file, flush=True)
        else:
            shown(message, category, filename, lineno, file, line)

    show.tessera_one_line = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    _one_line_warnings()
    args = build_parser().parse_args(argv)
    code = int(args.func(args) or 0)
    if args.command == "train" and code == 0:
        if under_torchrun():
            # a torchrun worker that finished its job ends the way the local launcher's ranks do
            # (multiprocessing leaves them with os._exit): the interpreter's teardown, after the process group
            # is destroyed, aborted about one run in ten here in a C++ destructor ("terminate called without
            # an active exception", SIGABRT) and failed a finished job. Everything is written and closed by
            # now. Not on an error: a rank that left at once would have torchrun kill rank 0 before it prints
            # the job's one error line.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


def exit_code(e: SystemExit) -> int:
    """The exit status the interpreter makes of `e` (argparse's usage errors 2, --help 0, sys.exit("message")):
    its int code, 0 for None, else 1 with the message written to stderr, as the interpreter writes it."""
    if isinstance(e.code, str):
        print(e.code, file=sys.stderr)
    return e.code if isinstance(e.code, int) else 0 if e.code is None else 1


def run() -> NoReturn:
    """The `tessera` command (console script, `python -m tessera`): main(), then the exit without the
    interpreter's teardown. Freeing torch's modules one by one took ~0.9 s of every command here (a plan, a
    finished run) after its work was done. What a normal exit does first still happens: other threads are
    joined, atexit handlers run (loggers, multiprocessing's finalizers), stdout and stderr are flushed. An
    exception takes the normal way out, with its traceback."""
    try:
        code = main()
    except SystemExit as e:
        code = exit_code(e)
    if under_torchrun():  # a failed worker leaves the normal way on purpose (main's comment; a finished train has left)
        sys.exit(code)
    # what a normal exit runs first, in its order (both private, both in typeshed): the other threads, idle
    # thread-pool workers told to stop first (threading._shutdown), then the atexit handlers
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    with contextlib.suppress(OSError):  # a closed pipe (`tessera plan ... | head`): nothing left to tell it
        sys.stdout.flush()
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()

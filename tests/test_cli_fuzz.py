"""Fuzzed command lines (issue: every subcommand, its own flags): `tessera <command>` with a random subset of
that parser's flags and random values (ints with 0, negatives and huge ones, floats with nan and inf, strings
with '' and paths such as /proc/x, a directory, a binary file, a FIFO) either works or ends with exit 2 and
one `tessera <command>: error: ...` line: no traceback, and no hang (a time limit on every example).

The flags are read from the parser itself (tessera.cli.build_parser), so a new flag is fuzzed as soon as it
exists (a new string flag must say whether it names a file to read or to write: test_every_string_flag_is_classified).
Each example calls the CLI's main in this process. The work behind the checks is stubbed so an example stays
cheap: `tessera train` runs through its pre-run checks (config and preflight) and stops where ranks would
start; bench stops before its sweep, check before its simulated world, plan --calibrate before measuring
(and never writes the calibration file), and --dry-run before building the model on the fake backend.
Everything is written inside a scratch directory (the working directory for the test)."""

import argparse
import contextlib
import functools
import io
import json
import os
import signal
import time
import traceback

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.cli import build_parser, main

EXAMPLE_SECONDS = 20  # per example: far above any check's cost (the machine may be loaded), far below a hang

PARSER = build_parser()
COMMANDS = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction)).choices

# files to read; the scratch directory holds the relative ones (see `workspace`)
INPUTS = [
    "",
    ".",
    "in",
    "in/file.txt",
    "in/blob.bin",
    "in/docs.jsonl",
    "in/tokenizer.json",
    "in/hf",
    "in/data",
    "in/data/shard_00000.bin",
    "in/badshard",
    "missing.txt",
    "/proc/x",
    "/proc/self/status",
    "/dev/zero",
    "/proc/x/y",
]
# files and directories to write: only inside the scratch directory, or places where even root can create
# nothing (never a device: os.replace would put a regular file in its place; never a missing absolute
# directory: root would create it)
OUTPUTS = [
    "",
    ".",
    "out",
    "out2/sub/dir",
    "taken.txt",
    "taken.txt/below",
    "pipe",
    "out.safetensors",
    "/proc/x",
    "/sys/x",
    "/proc/x/y",
    "/proc",
    "/sys",
]
JUNK = ["", " ", "x", "-", "0", "nan", "\u00e9\u00e8", "a,b", "1:2:3", "::", "None"]
# string flags whose values are names rather than paths: meaningful values first
KNOWN = {
    "model": [
        "debug",
        "small",
        "1b",
        "8b",
        "70b",
        "405b",
        "qwen3-debug",
        "qwen3-0.6b",
        "hf:in/hf",
        "hf:missing",
        "nope",
    ],
    "recipe": ["mixed_adam", "fp32_adam", "mixed_adam_fp32_grads", "mixed_muon", "adam8"],
    "separator": ["</s>", "[UNK]", "<nope>"],
    "field": ["text", "body"],
    "text_field": ["text", "body"],
    "device_kind": ["cpu", "H100", "tpu"],
    "hardware": ["h100-sxm-80gb", "a100-sxm-80gb", "nope", "in", "in.json"],
    "attention": ["cudnn", "flash2", "nope"],
    "calibration_overlay": ["H200", "cpu", "tpu"],
    "layout": ["dp8", "pp2xdp4", "tp2xdp4+sp", "dpr2xdp4+ac_op", "dp8+compile", "dp0", "xx", "tp8+nope"],
    "layouts": [
        "one",
        "dp2",
        "tp2+sp",
        "one,dp2",
        "pp2xdp2xcp2xtp2+sp",
        "dpr2xdp2",
        "dp0",
        "tp2+nope",
        "xx",
        ",",
        "one,,dp2",
    ],
    "device": ["auto", "cpu", "cuda", "tpu"],
    "fsdp": ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "ZERO4"],
    "ac": ["none", "full", "selective", "op", "some"],
    "mixed_precision": ["bf16", "fp32", "fp8"],
    "fp8": ["tensorwise", "rowwise", "blockwise"],
    "schedule": ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"],
    "pp_layers": ["1,1", "2,2", "3,1", "1,x", "4", "0,2", "-1,3"],
    "cp_method": ["ring", "allgather", "ulysses"],
    "offload": ["none", "optimizer", "params", "nvme"],
    "lighthouse": ["http://127.0.0.1:9", "127.0.0.1:9", "nohost", ""],
    "loss": ["fused", "plain", "chunked", "nope"],
    "kernels": ["auto", "torch", "triton", "cuda"],
    "on_nonfinite": ["stop", "skip", "ignore"],
    "profile_steps": ["2:3", "1:1", "3:2", "0:5", "a:b", "5", "2:"],
    "comm_stats": ["every", "first"],
    "muon_update_scale": ["original", "match_rms_adamw", "adam"],
    "muon_ns_coefficients": ["3.4445,-4.7750,2.0315", "1,2,3", "1,2", "a,b,c"],
    # tessera generate's prompt: text, or token ids (the debug presets' byte vocabulary), and its stop ids
    "prompt": ["The ", "hello world", "\u00e9"],
    "prompt_ids": ["256,84,104", "1", "1,x", "-1", "99999", "1,,2"],
    "stop_ids": ["257", "1,2", "x", "-3"],
    # a W&B project name (offline without a network; the run's files go under the run's own directory)
    "wandb": ["tessera-test", ""],
}
READS = {
    "checkpoint",
    "schedule_file",
    "from_hf",
    "files",
    "tokenizer",
    "calibration",
    "data",
    "eval_data",
    "resume",
    "init_from",
    "init_from_hf",
    "runs",  # tessera plot's metrics files
}
WRITES = {"out", "to_hf", "checkpoint_dir", "metrics", "profile", "tensorboard"}

# each value is sane or wild, about half and half, so that examples get past the first check as well
INTS = st.sampled_from(["1", "2", "4", "8", "16", "64", "256", "1024"]) | st.sampled_from(
    [
        "0",
        "-1",
        "3",
        "-2147483648",
        "1000000",
        "2147483648",
        "1000000000000000000",
        str(2**64),
        "1" + "0" * 40,
        "1.5",
        "x",
        "",
    ]
)
FLOATS = st.sampled_from(["0.5", "1", "80", "70e9", "0.1", "3e-4"]) | st.sampled_from(
    ["0", "-1", "nan", "inf", "-inf", "1e-300", "1e308", "1e30", "x", ""]
)
# flags an example usually gives (a command without them stops at its first check): flag -> commands
USUAL = {
    "gpus": {"plan"},
    "seq_len": {"plan"},
    "global_batch": {"plan"},
    "layouts": {"bench"},
    "layout": {"check"},
    "model": {"memory"},
    "out": {"export"},
    "files": {"tokenize"},
    "runs": {"plot"},
    "prompt_ids": {"generate"},
}


def _actions(parser):
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def _key(action):
    """A flag's name as the tables here spell it: --checkpoint-dir -> checkpoint_dir (train's dests are dotted)."""
    return action.option_strings[0][2:].replace("-", "_") if action.option_strings else action.dest


def _string_values(action):
    if _key(action) in KNOWN:
        return st.sampled_from(KNOWN[_key(action)] + JUNK)
    if _key(action) in WRITES:
        return st.sampled_from(OUTPUTS)
    return st.sampled_from(INPUTS)


def _values(action):
    """A strategy for the text of one value of `action`."""
    if action.choices is not None and action.type in (None, str):
        return st.sampled_from([*action.choices, "bogus", ""])
    if action.type is int:
        return INTS
    if action.type is not None and action.type is not str:  # float, or the CLI's _float
        return FLOATS
    return _string_values(action)


@st.composite
def command_lines(draw):
    name = draw(st.sampled_from(sorted(COMMANDS)))
    actions = _actions(COMMANDS[name])
    argv = [name]
    chosen = draw(st.lists(st.sampled_from(actions), unique_by=lambda a: a.dest, max_size=8))
    # a required flag is usually there (else argparse's usage error is all an example would see)
    chosen += [
        a
        for a in actions
        if (a.required or name in USUAL.get(_key(a), ())) and a not in chosen and draw(st.integers(0, 9)) > 0
    ]
    positionals = []
    for a in chosen:
        if not a.option_strings:
            n = 1 if a.nargs is None else draw(st.integers(1, 3))
            positionals += [draw(_values(a)) for _ in range(n)]
        elif a.nargs == 0:  # store_true / store_false
            argv.append(a.option_strings[0])
        elif a.nargs == "?" and draw(st.booleans()):
            argv.append(a.option_strings[0])
        else:
            argv.append(f"{a.option_strings[0]}={draw(_values(a))}")  # --flag=-1 is a value, not a flag
    return argv + (["--", *positionals] if positionals else [])


class ReachedTheWork(Exception):
    """A stub's signal: the command passed its checks and would now do its work."""


class Hang(BaseException):  # not an Exception: no `except Exception` in the command may swallow it
    pass


def _stop(*args, **kwargs):
    raise ReachedTheWork


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The scratch directory, with every input INPUTS names, the working directory of the fuzz."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tessera.models import get_preset
    from tessera.models.hf import hf_config_dict
    from tessera.data.tokens import write_shard

    root = tmp_path_factory.mktemp("fuzz")
    d = root / "in"
    d.mkdir()
    (d / "file.txt").write_text("the quick brown fox jumps over the lazy dog\n")
    (d / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (d / "docs.jsonl").write_text(json.dumps({"text": "the quick fox"}) + "\n" + json.dumps({"body": 1}) + "\n")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog"] * 10,
        trainers.BpeTrainer(vocab_size=50, special_tokens=["[UNK]", "</s>"]),
    )
    tok.save(str(d / "tokenizer.json"))
    (d / "hf").mkdir()  # a config.json without weights: convert and --init-from-hf read it, then refuse
    (d / "hf" / "config.json").write_text(json.dumps(hf_config_dict(get_preset("debug"))))
    (d / "data").mkdir()
    write_shard(d / "data" / "shard_00000", list(range(40)) * 5, 50, 1)
    (d / "badshard").mkdir()
    write_shard(d / "badshard" / "shard_00000", [1, 2, 3], 50, 1)
    (d / "badshard" / "shard_00000.json").write_text(
        json.dumps({"format": "tessera-tokens", "version": 1, "dtype": "uint16", "tokens": "3", "vocab_size": 50})
    )
    (root / "taken.txt").write_text("an existing file where a directory is asked for\n")
    os.mkfifo(root / "pipe")
    return root


@pytest.fixture(scope="module")
def cheap_cli(workspace):
    """The CLI with its work stubbed, in the scratch directory, with a time limit for an example."""
    import torch

    import importlib

    import tessera.commands.bench
    import tessera.commands.main
    import tessera.commands.calibrate
    import tessera.training.simulated
    import tessera.commands.generate
    import tessera.commands.plan
    import tessera.training.run

    parallelize = importlib.import_module("tessera.parallel.parallelize")  # the package's attribute is the function

    if tessera.training.run.under_torchrun():
        pytest.skip("under torchrun: `tessera train` would join the job")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tessera.training.run, "train", _stop)
        mp.setattr(tessera.commands.bench, "_sweep", _stop)
        mp.setattr(tessera.commands.calibrate, "measure", _stop)
        mp.setattr(tessera.training.simulated, "trace", _stop)  # tessera check's simulated world
        mp.setattr(tessera.commands.calibrate, "save", _stop)
        mp.setattr(tessera.commands.generate, "generate_job", _stop)
        mp.setattr(parallelize, "dry_run_model_states", _stop)
        mp.setattr(tessera.commands.plan, "_dry_run", _stop)
        mp.setattr(tessera.commands.lighthouse, "serve", _stop)  # a server answers until stopped
        # one parser for every example: building it is the same every time (16 ms, 10 of this test's 16 s),
        # and argparse keeps no state from one parse to the next
        mp.setattr(
            tessera.commands.main, "build_parser", functools.lru_cache(maxsize=1)(tessera.commands.main.build_parser)
        )
        mp.setenv("TESSERA_CALIBRATION", str(workspace / "calibration.json"))
        mp.chdir(workspace)
        threads = torch.get_num_threads()
        yield threads
        torch.set_num_threads(threads)


def run_command(argv, threads):
    """(outcome, exit code, stdout, stderr); outcome is 'ok', 'work' (reached a stub), 'traceback' or 'hang'."""
    import torch

    def timeout(signum, frame):
        raise Hang

    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, EXAMPLE_SECONDS)
    outcome, code = "ok", None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as e:  # argparse's usage errors
                code = e.code
    except ReachedTheWork:
        outcome = "work"
    except Hang:
        outcome = "hang"
    except Exception:  # noqa: BLE001 - the finding itself
        outcome, code = "traceback", traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        torch.set_num_threads(threads)  # plan --calibrate sets it before measuring
    return outcome, code, out.getvalue(), err.getvalue()


def check(argv, threads):
    started = time.perf_counter()
    outcome, code, out, err = run_command(argv, threads)
    said = f"tessera {' '.join(map(repr, argv))}"
    assert outcome != "traceback", f"{said} raised:\n{code}"
    assert outcome != "hang", f"{said} ran past {EXAMPLE_SECONDS} s"
    assert "Traceback" not in out + err, f"{said} printed a traceback:\n{err}"
    if outcome == "work":
        return
    assert code in (0, 2), f"{said} exited {code!r}:\n{err}"
    if code == 2:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        assert last.startswith(f"tessera {argv[0]}: error: ") and len(last) > len(f"tessera {argv[0]}: error: ") + 3, (
            f"{said}: its error is not one clear line:\n{err}"
        )
        # argparse's usage lines, and a progress bar (redrawn with \r) aside
        ours = [
            line
            for line in err.strip().split("\n")
            if line and not line.startswith(("usage:", " ")) and "\r" not in line
        ]
        assert len(ours) == 1, f"{said}: more than one line of error:\n{err}"
    assert time.perf_counter() - started < EXAMPLE_SECONDS


@settings(
    max_examples=600,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(command_lines())
def test_any_command_line_works_or_ends_with_one_clear_line(cheap_cli, argv):
    check(argv, cheap_cli)


# what the fuzz found before the fixes (tracebacks, a hang), and the cases
@pytest.mark.parametrize(
    "argv",
    [
        ["export", "--out=", "--", ""],
        ["memory", "--model=70b", "--tp=3"],
        ["memory", "--params=1e30", "--gpu-memory=1e-300"],
        ["memory", "--model=debug", "--dp=10000000", "--dry-run"],
        ["plan", "--model=8b", "--gpus=1000000000000", "--seq-len=1024", "--global-batch=8"],
        ["tokenize", "--tokenizer=in/tokenizer.json", "--out=taken.txt", "--", "in/blob.bin"],
        ["convert", "--from-hf=in/hf", "--out=pipe"],
        ["export", "--out=out.safetensors", "--", "in/data"],
        ["bench", "--layouts=one", "--out=taken.txt/below"],
        ["train", "--data=in/badshard", "--steps=1"],
        [
            "plan",
            "--model=8b",
            "--gpus=16",
            "--seq-len=1024",
            "--global-batch=1",
            "--device-kind=cpu",
            "--calibration=in/data",
        ],
        ["plan", "--model=debug", "--calibrate", "--calibration=in"],
        ["plan", "--model=debug", "--calibrate", f"--threads={10**18}"],
        # a calibration file that is a device: read without end (the fuzz process took 24 GB)
        [
            "plan",
            "--model=small",
            "--gpus=1",
            "--seq-len=1",
            "--global-batch=1",
            "--calibration=/dev/zero",
            "--calibration-overlay=H200",
        ],
    ],
)
def test_cases_the_fuzz_found(cheap_cli, argv):
    check(argv, cheap_cli)


def test_every_string_flag_is_classified():
    """A new string flag must say what its values are (KNOWN names, files it READS, or files it WRITES), so the
    fuzz never hands a file to read to a flag that overwrites it."""
    loose = sorted(
        {
            f"{name} {a.dest}"
            for name, p in COMMANDS.items()
            for a in _actions(p)
            if a.type in (None, str)
            and a.nargs != 0
            and a.choices is None
            and _key(a) not in KNOWN.keys() | READS | WRITES
        }
    )
    assert not loose, f"classify these flags in tests/test_cli_fuzz.py: {loose}"

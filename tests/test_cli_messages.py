"""Every CLI error names the file or the flag, with the fix, in one line (exit 2, no traceback): tokenize's
inputs and --out, damaged token shards, bench's --out, convert's own --from-hf, export's and convert's --out,
and `tessera memory`'s checks, which all come before any output. And every subcommand's --help works."""

import json
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.cli import main

SUBCOMMANDS = (
    "train",
    "memory",
    "check",
    "plan",
    "bench",
    "export",
    "convert",
    "tokenize",
    "plot",
    "generate",
    "lighthouse",
)


def run(capsys, *argv):
    """(exit code, stdout, stderr) of `tessera argv` in this process."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse: --help, usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error(capsys, command, *argv):
    """The one error line of a command that must fail with exit 2 before doing anything."""
    code, out, err = run(capsys, command, *argv)
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "[Errno" not in err, err
    assert out == "", out  # nothing printed before the refusal (memory used to print its whole table first)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tessera {command}: error: "), err
    return lines[0].removeprefix(f"tessera {command}: error: ")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["the quick brown fox", "jumps over the lazy dog"] * 20,
        trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "</s>"]),
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    """No test here may start ranks: reaching the run itself is a failure."""
    import tessera.commands.bench
    import tessera.commands.generate
    import tessera.training.run

    def refuse(*args, **kwargs):
        raise AssertionError("the command went past its checks")

    monkeypatch.setattr(tessera.training.run, "train", refuse)
    monkeypatch.setattr(tessera.commands.bench, "_sweep", refuse)
    monkeypatch.setattr(tessera.commands.generate, "generate_job", refuse)


# ----------------------------------------------------------------------------- 1. tokenize, token files, --out
def test_tokenize_names_a_file_that_is_not_utf8_text(tmp_path, capsys, tokenizer_file):
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)))
    msg = one_error(
        capsys,
        "tokenize",
        "--tokenizer",
        str(tokenizer_file),
        "--out",
        str(tmp_path / "o"),
        "--quiet",
        str(tmp_path / "blob.txt"),
    )
    assert (
        msg == f"{tmp_path / 'blob.txt'}: not UTF-8 text (byte 0x80 at offset 128); tokenize text (.txt) or JSONL "
        f"files, saved as UTF-8"
    )
    (tmp_path / "docs.jsonl").write_bytes(b'{"text": "the fox"}\n\xff\n')
    msg = one_error(
        capsys,
        "tokenize",
        "--tokenizer",
        str(tokenizer_file),
        "--out",
        str(tmp_path / "o"),
        "--quiet",
        str(tmp_path / "docs.jsonl"),
    )
    assert msg.startswith(f"{tmp_path / 'docs.jsonl'}:2: not UTF-8 text (byte 0xff at offset 0)")


def test_tokenize_says_a_directory_input_is_a_directory(tmp_path, capsys, tokenizer_file):
    (tmp_path / "docs").mkdir()
    msg = one_error(
        capsys, "tokenize", "--tokenizer", str(tokenizer_file), "--out", str(tmp_path / "o"), str(tmp_path / "docs")
    )
    assert (
        msg == f"{tmp_path / 'docs'} is a directory; name the files in it "
        f"(e.g. {tmp_path / 'docs'}/*.txt: the shell expands it)"
    )
    msg = one_error(
        capsys, "tokenize", "--tokenizer", str(tmp_path), "--out", str(tmp_path / "o"), str(tmp_path / "docs")
    )
    assert msg == f"--tokenizer {tmp_path} is a directory; name a file in it"
    assert (
        one_error(
            capsys,
            "tokenize",
            "--tokenizer",
            str(tokenizer_file),
            "--out",
            str(tmp_path / "o"),
            str(tmp_path / "nope.txt"),
        )
        == f"{tmp_path / 'nope.txt'}: no such file"
    )


@pytest.mark.parametrize("command", ["tokenize", "bench"])
def test_out_that_cannot_be_a_directory_is_named_with_the_fix(tmp_path, capsys, tokenizer_file, command):
    (tmp_path / "a.txt").write_text("the quick brown fox")
    (tmp_path / "taken").write_text("a file")
    before = {
        "tokenize": ["--tokenizer", str(tokenizer_file), "--quiet", str(tmp_path / "a.txt")],
        "bench": ["--layouts", "one", "--no-calibrate"],
    }[command]

    def out(path):
        return one_error(capsys, command, *before, "--out", path)

    assert out(str(tmp_path / "taken")) == (
        f"--out {tmp_path / 'taken'} is a file, not a directory; name a directory (it is created if missing)"
    )  # was [Errno 17] File exists
    assert out(str(tmp_path / "taken" / "sub")) == (
        f"--out {tmp_path / 'taken' / 'sub'}: {tmp_path / 'taken'} is a "
        f"file, not a directory; name a directory elsewhere"
    )  # [Errno 20]
    assert out("/proc/tessera-out") == (
        "--out /proc/tessera-out cannot be created (No such file or directory); choose a writable directory"
    )  # [Errno 2]
    assert out("") == "--out '' is an empty path; name the directory to write into"
    # a directory that exists but takes no files (root passes its permission bits): found before any work
    assert out("/proc").startswith("--out /proc ") and (
        "cannot be written" in out("/proc") or "not writable" in out("/proc")
    )


def test_out_on_a_read_only_file_system_is_named(tmp_path, capsys, monkeypatch, tokenizer_file):
    """[Errno 30] as the user saw it: the mkdir of --out fails with EROFS."""
    import errno
    import pathlib

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    (tmp_path / "a.txt").write_text("the quick brown fox")
    msg = one_error(
        capsys,
        "tokenize",
        "--tokenizer",
        str(tokenizer_file),
        "--out",
        str(tmp_path / "ro"),
        "--quiet",
        str(tmp_path / "a.txt"),
    )
    assert msg == f"--out {tmp_path / 'ro'} cannot be created (Read-only file system); choose a writable directory"
    msg = one_error(capsys, "bench", "--layouts", "one", "--out", str(tmp_path / "ro"))
    assert msg == f"--out {tmp_path / 'ro'} cannot be created (Read-only file system); choose a writable directory"


def test_a_shard_description_with_a_bad_field_names_the_file_and_the_field(tmp_path, capsys, tokenizer_file):
    from tessera.data.tokens import open_dataset, write_shard

    write_shard(tmp_path / "shard_00000", [1, 2, 3, 1], 60, 1)
    meta_path = tmp_path / "shard_00000.json"
    meta = json.loads(meta_path.read_text())
    for field, value in (("tokens", "abc"), ("vocab_size", None), ("separator", 2.5), ("tokens", -4)):
        meta_path.write_text(json.dumps({**meta, field: value}))
        with pytest.raises(ValueError) as e:
            open_dataset(tmp_path)
        word = "above 0" if field == "vocab_size" else "of 0 or more"
        assert str(e.value) == (
            f"{meta_path}: field {field!r} is {value!r}, not a whole number {word} (a damaged file); "
            f"write the shard again with `tessera tokenize`"
        )  # was: invalid literal for int()
    meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "separator"}))  # was a KeyError
    with pytest.raises(ValueError, match=r"field 'separator' is None"):
        open_dataset(tmp_path)
    meta_path.write_text("[1, 2]")  # was an AttributeError
    with pytest.raises(ValueError, match=r"shard_00000.json: not a token shard's description"):
        open_dataset(tmp_path)
    # and through the command, before any rank starts
    meta_path.write_text(json.dumps({**meta, "tokens": "abc"}))
    msg = one_error(
        capsys,
        "train",
        "--data",
        str(tmp_path),
        "--vocab-size",
        "60",
        "--steps",
        "1",
        "--seq-len",
        "2",
        "--global-batch",
        "1",
    )
    assert msg.startswith(f"{meta_path}: field 'tokens' is 'abc'")


# ----------------------------------------------------------------------------- 2. convert names its own flag
def test_convert_names_from_hf_not_init_from_hf(tmp_path, capsys):
    out = str(tmp_path / "x.safetensors")
    for directory, want in (
        (
            tmp_path / "nowhere",
            f"--from-hf {tmp_path / 'nowhere'}: no such directory; name a Hugging Face model "
            f"directory (config.json, model.safetensors)",
        ),
        (tmp_path, f"--from-hf {tmp_path}: no config.json in it (a Hugging Face model directory)"),
    ):
        assert one_error(capsys, "convert", "--from-hf", str(directory), "--out", out) == want
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))  # was a KeyError
    assert one_error(capsys, "convert", "--from-hf", str(tmp_path), "--out", out) == (
        f"{tmp_path / 'config.json'}: no 'num_attention_heads' field (the llama config needs it); --from-hf takes a "
        f"complete Hugging Face config.json"
    )
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "vocab_size": 100,
                "intermediate_size": 128,
            }
        )
    )
    assert one_error(capsys, "convert", "--from-hf", str(tmp_path), "--out", out) == (
        f"--from-hf {tmp_path}: no model.safetensors or model.safetensors.index.json "
        f"(pytorch_model.bin pickles are not read: they can run code)"
    )
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")  # was safetensors' own exception
    assert one_error(capsys, "convert", "--from-hf", str(tmp_path), "--out", out).startswith(
        f"{tmp_path / 'model.safetensors'}: not a safetensors file ("
    )
    # the train command keeps naming its own flag
    msg = one_error(capsys, "train", "--init-from-hf", str(tmp_path / "nowhere"), "--steps", "1")
    assert msg.startswith(f"--init-from-hf {tmp_path / 'nowhere'}: no such directory")


def test_export_and_convert_refuse_an_out_that_is_not_a_regular_file(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for command, before in (("convert", ["--from-hf", str(tmp_path)]), ("export", [str(tmp_path / "ckpt")])):
        assert one_error(capsys, command, *before, "--out", str(fifo)) == (
            f"--out {fifo} is not a regular file (a device or a pipe); name the .safetensors file to write"
        )
        assert one_error(capsys, command, *before, "--out", str(tmp_path)) == (
            f"--out {tmp_path} is a directory; name the .safetensors file to write (e.g. {tmp_path}/model.safetensors)"
        )
        assert one_error(capsys, command, *before, "--out", "") == (
            "--out '' is an empty path; name the .safetensors file to write"
        )
    assert fifo.exists() and not fifo.is_file()  # left as it was


# ----------------------------------------------------------------------------- 3. tessera memory
def test_memory_refuses_a_tp_that_does_not_divide_the_heads_naming_the_divisors(capsys):
    assert one_error(capsys, "memory", "--model", "70b", "--tp", "3") == (
        "--tp 3 does not fit the 70b preset (n_heads=64): tp must divide n_heads; use --tp 1, 2, 4, 8, 16, 32 or 64"
    )
    assert one_error(capsys, "memory", "--model", "70b", "--pp", "81", "--json") == (
        "--pp 81 does not fit the 70b preset (n_layers=80): pp must be at most n_layers (every stage holds a block); "
        "use --pp 1 to 80"
    )


def test_memory_takes_params_or_a_model_not_both(capsys):
    assert one_error(capsys, "memory", "--params", "70e9", "--model", "8b") == (
        "give --params N or --model PRESET, not both (--model 8b has its own parameter count): drop one"
    )


@pytest.mark.parametrize(
    "argv,want",
    [
        (["--gpu-memory", "-1"], "--gpu-memory -1 must be a positive number of GB per GPU, e.g. --gpu-memory 80"),
        (["--gpu-memory", "nan"], "--gpu-memory nan must be a positive number of GB per GPU, e.g. --gpu-memory 80"),
        (
            ["--dry-run"],
            "--dry-run needs --model PRESET (it builds that model on the meta device); drop --dry-run or give "
            "--model instead of --params",
        ),
        (
            ["--recipe", "adam8"],
            "unknown memory recipe 'adam8'; choose one of mixed_adam, fp32_adam, mixed_adam_fp32_grads, "
            "mixed_muon, fp32_muon",
        ),
    ],
)
def test_memory_checks_everything_before_printing_the_table(capsys, argv, want):
    assert one_error(capsys, "memory", "--params", "70e9", *argv) == want  # one_error: and no table on stdout


def test_memory_params_must_be_a_count(capsys):
    assert (
        one_error(capsys, "memory", "--params", "-5")
        == "--params -5 must be a positive parameter count, e.g. --params 70e9"
    )
    assert one_error(capsys, "memory", "--params", "1e308") == (
        "--params 1e+308 is too large: its model states overflow a float; give a real count"
    )


@pytest.mark.parametrize("params", ["1e30", "1e15", "70e9", "1"])
def test_memory_columns_never_merge(capsys, params):
    code, out, err = run(capsys, "memory", "--params", params, "--dp", "3", "--gpu-memory", "80")
    assert code == 0, err
    rows = [
        line
        for line in out.splitlines()
        if line.split()[:1] in (["parameters"], ["gradients"], ["optimizer"], ["total"])
    ]
    assert len(rows) == 4
    for line in rows:
        cells = line[12:].split("GB")[:-1]
        assert len(cells) == 4 and all(c.startswith("  ") and c.strip() for c in cells), line  # 2+ spaces between
        assert len(line.split()) == 9, line
    header = next(line for line in out.splitlines() if "ZeRO-0" in line)
    assert len(header) == len(rows[0]) and header.split() == ["ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"]


def test_a_small_models_states_are_not_printed_as_zero(capsys):
    """The debug model's 131,648 parameters hold 2.1 MB of states: the table printed 0.00 GB in every cell."""
    code, out, err = run(capsys, "memory", "--model", "debug")
    assert code == 0, err
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert "0.00 GB" not in out and total.split()[1:3] == ["0.00211", "GB"], total


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.just(0.0), st.floats(1, 1e40)))  # a byte count: none, or at least one
def test_gigabytes_reads_back_within_its_rounding_and_never_hides_a_nonzero(n_bytes):
    from tessera.topology.memory import GB, gigabytes

    text = gigabytes(n_bytes)
    back = float(text) * GB
    assert (text == "0.00") == (n_bytes == 0)
    assert back == pytest.approx(n_bytes, rel=5e-3, abs=0.005 * GB if n_bytes >= 0.1 * GB else 0)
    assert len(text) <= 10


# ----------------------------------------------------------------------------- what the fuzz found (test_cli_fuzz.py)
def test_plan_names_a_calibration_path_that_is_a_directory_and_refuses_absurd_counts(tmp_path, capsys, monkeypatch):
    import tessera.commands.calibrate

    monkeypatch.setattr(
        tessera.commands.calibrate, "measure", lambda *a, **k: pytest.fail("measured despite a bad --calibration")
    )
    common = ["--model", "8b", "--gpus", "16", "--seq-len", "1024", "--global-batch", "8"]
    want = f"--calibration {tmp_path} is a directory; name the calibration file (e.g. {tmp_path}/calibration.json)"
    assert (
        one_error(capsys, "plan", *common, "--device-kind", "cpu", "--calibration", str(tmp_path)) == want
    )  # IsADirectoryError
    assert one_error(capsys, "plan", "--model", "debug", "--calibrate", "--calibration", str(tmp_path)) == want
    assert one_error(capsys, "plan", "--model", "debug", "--calibrate", "--threads", str(10**18)) == (
        "--threads 1,000,000,000,000,000,000 is more threads than torch takes; use this machine's cores"
    )
    assert one_error(capsys, "plan", *common[:2], "--gpus", str(10**12), *common[4:]) == (  # was a hang (minutes)
        "--gpus 1,000,000,000,000 is more than the planner enumerates (at most 4,194,304); plan a smaller job"
    )


def test_memory_dry_run_refuses_a_fake_world_too_large_to_build(capsys):
    # (10**7 ranks, the hang found, is now refused as more than any job: test_memory.py)
    assert one_error(capsys, "memory", "--model", "debug", "--dp", str(1 << 17), "--dry-run") == (  # was a hang
        "--dry-run builds the mesh of every fake rank, and 131,072 ranks are too many for one process (at most "
        "65,536); drop --dry-run for the analytic table"
    )
    assert one_error(capsys, "memory", "--params", "1e30", "--gpu-memory", "1e-300").startswith(
        "--gpu-memory 1e-300 is"
    )


def test_export_with_an_empty_out_is_refused_not_a_traceback(capsys):
    assert (
        one_error(capsys, "export", "ckpt", "--out", "")
        == "--out '' is an empty path; name the .safetensors file to write"
    )


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):
    """A Hugging Face folder of a debug Llama with a context of 8 tokens and a vocabulary of 96 (not bytes)."""
    from tessera.models import build_model, get_preset
    from tessera.models.hf import save_hf

    cfg = get_preset("debug", max_seq_len=8, vocab_size=96)
    path = tmp_path_factory.mktemp("hf")
    save_hf(build_model(cfg).state_dict(), cfg, path)
    return path


def test_generate_refuses_bad_input_in_one_line_before_any_rank(capsys, tmp_path, small_hf):
    hf = f"hf:{small_hf}"
    assert one_error(capsys, "generate", "--checkpoint", str(tmp_path), "--prompt-ids", "1") == (
        f"no manifest.json (and no 'latest' pointer) in {tmp_path}: not a tessera checkpoint, or an interrupted save"
    )
    assert one_error(capsys, "generate", "--checkpoint", f"hf:{tmp_path}", "--prompt-ids", "1") == (
        f"--checkpoint hf:{tmp_path}: no config.json in it (a Hugging Face model directory)"
    )
    assert one_error(capsys, "generate", "--checkpoint", hf, "--prompt-ids", "1,2,3,4,5,6,7,8,9") == (
        "the prompt is 9 tokens, longer than the model's context of 8 tokens (max_seq_len) with room for one "
        "more; shorten it to at most 7 tokens"
    )
    assert one_error(capsys, "generate", "--checkpoint", hf, "--prompt-ids", "1,2,3", "--max-new-tokens", "6") == (
        "--max-new-tokens 6 after a prompt of 3 tokens passes the model's context of 8 tokens; use "
        "--max-new-tokens 5 or fewer"
    )
    assert one_error(capsys, "generate", "--checkpoint", hf, "--prompt-ids", "1", "--tp", "3") == (
        "--tp 3 does not divide the 4 attention heads; use a tp that divides 4"
    )
    for top_p in ("0", "1.5", "-1"):
        message = one_error(capsys, "generate", "--checkpoint", hf, "--prompt-ids", "1", "--top-p", top_p)
        assert message == f"--top-p {float(top_p)} is outside (0, 1]; use e.g. 0.9 (1 keeps every token)"
    # no silent no-op: a nucleus under greedy decoding (the default temperature) would change nothing
    assert one_error(capsys, "generate", "--checkpoint", hf, "--prompt-ids", "1", "--top-p", "0.5") == (
        "--top-p 0.5 samples, and --temperature 0 is greedy; give a temperature above 0 (e.g. --temperature 0.8) "
        "to sample, or keep --top-p 1"
    )
    assert one_error(capsys, "generate", "--checkpoint", hf, "--prompt", "hello") == (
        "--prompt needs a tokenizer for this model's vocabulary of 96: give --tokenizer tokenizer.json (or a "
        "Hugging Face model folder), or the ids with --prompt-ids 1,2,3"
    )
    assert one_error(capsys, "generate", "--checkpoint", hf, "--prompt-ids", "1,96") == (
        "the prompt holds token id 96, outside the model's vocabulary of 96 (a tokenizer of another model?)"
    )
    # issue 65 item 7: a stop id the model can never emit was accepted, and would never stop it
    assert one_error(
        capsys, "generate", "--checkpoint", hf, "--prompt-ids", "1", "--max-new-tokens", "2", "--stop-ids", "9999"
    ) == (
        "--stop-ids 9999 is outside the model's vocabulary of 96 (ids 0 .. 95): the model never emits it, so "
        "it would never stop; give ids it can emit"
    )


# ----------------------------------------------------------------------------- 4. --help everywhere
@pytest.mark.parametrize("command", [None, *SUBCOMMANDS])
def test_every_help_works(capsys, command):
    code, out, err = run(capsys, *([command] if command else []), "--help")
    assert code == 0 and out.strip() and "usage: tessera" in out and not err, (code, err)
    if command is None:
        assert all(c in out for c in SUBCOMMANDS)


def test_every_subcommand_has_a_help_test():
    import argparse

    from tessera.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(SUBCOMMANDS)  # a new subcommand joins SUBCOMMANDS (and the fuzz)


# ----------------------------------------------------------------------------- 5. issue 40's wording
def _subparser(name):
    import argparse

    from tessera.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_train_help_gives_every_option_a_plain_metavar(capsys):
    """Issue 40: the metavars read PARALLEL.PP and OPTIMIZER.LR (argparse's from the dotted dests)."""
    taking = [a for a in _subparser("train")._actions if a.option_strings and a.nargs != 0]
    assert len(taking) > 40
    for a in taking:
        dotted = re.fullmatch(r"[A-Z_]+\.[A-Z_]+", a.metavar or "")  # SECTION.FIELD
        assert a.metavar and not dotted and a.metavar != a.dest.upper(), (a.option_strings, a.metavar)
    code, out, _ = run(capsys, "train", "--help")
    assert code == 0 and "PARALLEL." not in out and "OPTIMIZER." not in out and "[--lr RATE]" in out
    assert "[--pp N]" in out and "[--timeout SECONDS]" in out


def test_keep_checkpoints_help_says_zero_keeps_all(capsys):
    code, out, _ = run(capsys, "train", "--help")
    assert "keep the newest K checkpoints (0: keep all)" in " ".join(out.split())


def test_bench_help_explains_seq_len_and_steps():
    helps = {a.option_strings[0]: a.help for a in _subparser("bench")._actions if a.option_strings}
    assert helps["--seq-len"] and "tokens per sequence" in helps["--seq-len"]
    assert helps["--steps"] and "--warmup" in helps["--steps"]
    assert all(helps[o] for o in helps), [o for o in helps if not helps[o]]


@pytest.mark.parametrize("layouts", ["xx", "dp2x", "dp2xxtp2"])
def test_bench_names_a_malformed_layout_as_given(capsys, tmp_path, layouts):
    """Issue 40: `--layouts xx` said "'' is not <axis><degree>" (the empty terms between the x's)."""
    message = one_error(capsys, "bench", "--layouts", layouts, "--out", str(tmp_path / "b"))
    assert message.startswith(f"layout '{layouts}': its degrees are not each <axis><degree> with axis pp, dpr, dp")
    assert "''" not in message
    assert one_error(capsys, "bench", "--layouts", "dp2,,tp2", "--out", str(tmp_path / "b")) == (
        "--layouts 'dp2,,tp2' has an empty layout name; give comma-separated layouts, e.g. --layouts one,dp2,tp2"
    )


def test_pp_layers_with_an_empty_stage_says_so(capsys):
    """Issue 40: `--pp-layers 0,2` said "summing to --n-layers 2 (they sum to 2)"."""
    assert one_error(capsys, "train", "--pp", "2", "--n-layers", "2", "--pp-layers", "0,2") == (
        "--pp-layers 0,2 leaves stage 0 without a layer (0); each stage needs at least one (e.g. --pp-layers 1,1)"
    )


def test_a_dp_the_replicas_do_not_divide_gets_a_fix_the_batch_takes(capsys):
    """Issue 40: `--dp 4 --dp-replicate 3` suggested --dp 3, which the default global batch of 8 then refused."""
    assert one_error(capsys, "train", "--dp", "4", "--dp-replicate", "3") == (
        "--dp-replicate 3 must divide --dp 4 (dp = dp_replicate x dp_shard); no multiple of 3 splits --global-batch 8 "
        "either: use --dp-replicate 2 or 4 (dividing --dp 4), or --dp 3 with --global-batch 9"
    )
    assert one_error(capsys, "train", "--dp", "6", "--dp-replicate", "4") == (
        "--dp-replicate 4 must divide --dp 6 (dp = dp_replicate x dp_shard); use --dp 4"
    )


def test_fp8_refusals_come_in_one_line_before_any_rank(capsys, monkeypatch):
    """--fp8: an unknown recipe, torchao missing (naming the extra), a GPU without FP8 matmuls."""
    import sys

    import torch

    assert one_error(capsys, "train", "--fp8", "blockwise") == (
        "unknown --fp8 recipe 'blockwise'; use one of tensorwise, rowwise"
    )
    with monkeypatch.context() as mp:
        mp.setitem(sys.modules, "torchao.float8", None)  # import fails as it does where torchao is not installed
        assert "install tessera's fp8 extra: pip install -e '.[fp8]'" in one_error(
            capsys, "train", "--fp8", "tensorwise"
        )
    for name, value in (("is_available", True), ("device_count", 1), ("get_device_capability", (8, 0))):
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value: v)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    assert one_error(capsys, "train", "--fp8", "rowwise", "--device", "cuda") == (
        "--fp8 rowwise on a GPU of compute capability 8.0 (NVIDIA A100-SXM4-80GB): FP8 matmuls need 8.9 or newer "
        "(Ada, Hopper, Blackwell); drop --fp8"
    )


@pytest.mark.parametrize("rank, local_rank, waits", [("0", "0", False), ("1", "1", True), ("2", "0", True)])
def test_under_torchrun_only_rank_0_prints_a_refusal_and_the_others_wait_to_be_stopped(
    monkeypatch, capsys, rank, local_rank, waits
):
    """A refusal every torchrun worker makes alike: rank 0 prints the one line and returns at once; the others
    print nothing and wait for torchrun to stop them, so none can leave first and have rank 0 killed before its
    line (tests/test_cli_train.py runs it under torchrun)."""
    from tessera.training import report

    slept = []
    monkeypatch.setattr(report.time, "sleep", slept.append)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["train", "--tp", "3"]) == 2
    printed = capsys.readouterr().err.strip().splitlines()
    if rank == "0":
        assert len(printed) == 1 and printed[0].startswith("tessera train: error: WORLD_SIZE=4"), printed
    else:
        assert printed == []
    assert slept == ([report.REFUSAL_WAIT_S] if waits else [])


@pytest.mark.parametrize(
    "argv, said",
    [
        (["train", "--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd' (choose from 'adamw', 'muon')"),
        (["train", "--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
        (["train", "--comm-stats", "nosuch"], "argument --comm-stats"),
        (["bench", "--layouts", "one"], "the following arguments are required: --out"),
        (["plan", "--model", "8b", "--gpus", "x"], "argument --gpus: invalid int value: 'x'"),
        (["nosuch"], "argument command: invalid choice: 'nosuch'"),
        (["plan", "--model", "8b", "--gpus", "8", "--seq-len", "8", "--global-batch", "8", "--fp8", "nosuch"],
         "--fp8 'nosuch' is not an FP8 recipe: use one of tensorwise, rowwise, or plan without fp8"),
    ],
)  # fmt: skip
def test_argparse_errors_are_one_line_as_tesseras_own(capsys, argv, said):
    """Issue 65 item 10: argparse's choice and type errors printed the whole usage first (31 lines for train),
    where tessera's own errors are one line; `plan --fp8 nosuch` ended '(or None)'."""
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and lines[0].startswith("tessera"), err


def test_convert_and_export_help_name_every_family_they_read_and_write(capsys):
    """Issue 65 item 14: convert --help named Llama and Qwen3 only, export --help three architectures."""
    from tessera.models.spec import families

    code, out, _ = run(capsys, "convert", "--help")
    assert code == 0 and "Llama, Qwen3, Qwen3-MoE, DeepSeek-V3, gpt-oss" in " ".join(out.split())
    code, out, _ = run(capsys, "export", "--help")
    text = " ".join(out.split())
    for spec in families().values():
        if spec.hf is not None:
            assert spec.hf.architecture in text, spec.hf.architecture


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_help_page_fits_78_columns(capsys, command):
    """bench --help ran to 111 columns where every other page kept within 78."""
    code, out, _ = run(capsys, command, "--help")
    wide = [line for line in out.splitlines() if len(line) > 78]
    assert code == 0 and not wide, wide


# ----------------------------------------------------------------------------- what a new user met (2026-12-03)
def test_a_checkpoint_that_is_a_file_is_named_so_not_called_missing(capsys, tmp_path):
    """A file given where a checkpoint directory goes: "is a file", not "does not exist"; and a refused resume
    leaves no --checkpoint-dir behind."""
    pt = tmp_path / "model.pt"
    pt.write_bytes(b"not a checkpoint")
    said = one_error(capsys, "train", "--model", "debug", "--steps", "2", "--resume", str(pt))
    assert said == f"checkpoint {pt} is a file; a tessera checkpoint is a directory holding manifest.json", said
    missing = tmp_path / "never"
    said = one_error(capsys, "train", "--model", "debug", "--checkpoint-dir", str(missing), "--resume")
    assert said == f"checkpoint {missing} does not exist" and not missing.exists()


def test_export_refuses_to_write_into_the_checkpoint_it_reads(capsys, tmp_path):
    said = one_error(capsys, "export", str(tmp_path), "--to-hf", str(tmp_path / "hf"))
    assert said.startswith(f"--to-hf {tmp_path / 'hf'} is inside the checkpoint {tmp_path} it reads"), said


def test_lighthouse_names_only_the_value_that_is_wrong(capsys):
    assert one_error(capsys, "lighthouse", "--port", "-1") == "--port -1 must be within 0..65535"
    assert one_error(capsys, "lighthouse", "--min-replicas", "0", "--heartbeat-timeout", "0") == (
        "--min-replicas 0 must be at least 1; --heartbeat-timeout 0 must be above 0"
    )


def test_memory_refuses_ep_for_a_parameter_count_without_experts(capsys):
    assert one_error(capsys, "memory", "--params", "70e9", "--dp", "8", "--ep", "2").startswith(
        "--ep 2 splits a model's experts, and --params 7e+10 names no experts"
    )


def test_the_python_api_refuses_a_value_of_the_wrong_type_by_name():
    """Config.create takes any value; the check names a field whose value is not its type (steps=2.5 used to
    train, lr="0.1" to meet a bare TypeError), before any other check reads it."""
    from tessera.config import Config
    from tessera.topology.errors import ConfigError

    for kw, said in [
        (dict(steps=2.5), "steps=2.5 must be an int, not a float"),
        (dict(lr="0.1"), "lr='0.1' must be a number, not a str"),
        (dict(tp="2"), "tp='2' must be an int, not a str"),
        (dict(steps=True), "steps=True must be an int, not a bool"),
    ]:
        with pytest.raises(ConfigError) as e:
            Config.create(model="debug", quiet=True, **kw).check(flags={})
        assert str(e.value) == said
    Config.create(model="debug", quiet=True, lr=1).check()  # an int where a float goes is a number

"""Library errors name the Python API's parameters, the CLI adds the flags (issue 26, item 2): a library check
says `seq_len=30` (or `dp` in backquotes, a parameter without a value), and `with_flags` over the command's
map (flag_names() for `tessera train`, a subcommand's own parser for the others) writes `--seq-len 30`.
One representative call per module, in-process and without ranks; and a scan of the library's sources for
messages that still spell a flag, outside the places that legitimately write a command line."""

from __future__ import annotations

import ast
import json
import os
import re
import socket
from pathlib import Path

import pytest

from tessera.cli import build_parser
from tessera.config import flag_names
from tessera.data.corpus import TokenStream
from tessera.models.hf import read_hf_config
from tessera.data.tokens import TokenFileStream, open_dataset
from tessera.checkpointing import checkpoint
from tessera.parallel.context import check_context
from tessera.parallel.fsdp import DataParallelConfig, check_data_parallel
from tessera.parallel.expert import check_expert_parallel
from tessera.parallel.loss import check_loss
from tessera.parallel.pipeline import PipelineConfig, check_pipeline
from tessera.topology import Layout
from tessera.topology.errors import ConfigError, with_flags
from tessera.topology.estimators.planner import Candidate, Hardware, why_not_runnable
from tessera.topology.shapes import ModelShape, split_layers

ROOT = Path(__file__).resolve().parents[1]
TRAIN = flag_names()


def subcommand_flags(name: str) -> dict[str, str]:
    """The parameter -> flag map `tessera <name>` rewrites its errors with (build_parser's args.flags)."""
    sub = next(a for a in build_parser()._actions if getattr(a, "choices", None) and name in a.choices)
    return sub.choices[name].get_default("flags")


def says(error: pytest.ExceptionInfo) -> str:
    return str(error.value)


def test_with_flags_writes_values_and_backquoted_names_as_flags():
    flags = {"dp": "--dp", "cp": "--cp", "seq_len": "--seq-len"}
    assert (
        with_flags("seq_len=30 must divide; raise `dp` or `cp`", flags)
        == "--seq-len 30 must divide; raise --dp or --cp"
    )
    # names it does not know stay as the library wrote them; so does a dotted or longer name
    assert with_flags("`tp` and tp=2, x.seq_len=3, max_seq_len=4", flags) == "`tp` and tp=2, x.seq_len=3, max_seq_len=4"


def test_context_parallel_names_seq_len_and_cp_method():
    with pytest.raises(ValueError) as e:
        check_context(30, 2)
    assert says(e) == (
        "seq_len=30 does not split into 2 x cp = 4 equal chunks (zigzag context parallel); use seq_len=28 or 32"
    )
    assert with_flags(says(e), TRAIN).endswith("; use --seq-len 28 or 32")
    assert with_flags(says(e), TRAIN).startswith("--seq-len 30 does not split")
    with pytest.raises(ValueError) as e:
        check_context(32, 2, method="ulysses")
    assert says(e) == "unknown cp_method='ulysses'; use one of ring, allgather"
    assert with_flags(says(e), TRAIN) == "unknown --cp-method 'ulysses'; use one of ring, allgather"


def test_the_stage_split_names_layers_per_stage_and_n_layers():
    with pytest.raises(ValueError) as e:
        split_layers(4, 2, [3, 2])
    assert says(e) == "layers_per_stage=3,2 must be positive counts summing to n_layers=4 (they sum to 5)"
    assert (
        with_flags(says(e), TRAIN) == "--pp-layers 3,2 must be positive counts summing to --n-layers 4 (they sum to 5)"
    )
    with pytest.raises(ValueError) as e:
        split_layers(2, 4)
    assert says(e).endswith("lower `pp`/`virtual` or use n_layers=4 or more")
    assert with_flags(says(e), TRAIN).endswith("lower --pp/--virtual or use --n-layers 4 or more")


def test_parallel_checks_name_their_parameters():
    cases = [
        (lambda: check_loss("fused"), "unknown loss='fused'", "unknown --loss 'fused'"),
        (
            lambda: check_data_parallel(DataParallelConfig("HYBRID_SHARD"), Layout(dp_shard=4)),
            "pass dp_replicate=R with R dividing 4 (e.g. dp_replicate=2)",
            "pass --dp-replicate R with R dividing 4 (e.g. --dp-replicate 2)",
        ),
        (
            lambda: check_expert_parallel(8, 4, 2),
            "raise `dp` or `cp`, or use `ep` dividing 2",
            "raise --dp or --cp, or use --ep dividing 2",
        ),
        (
            lambda: check_pipeline(PipelineConfig("zb-h1", microbatches=4), 2, 4, False, "full"),
            "schedule=zb-h1 with activation_checkpointing=full is not supported",
            "--schedule zb-h1 with --ac full is not supported",
        ),
        (
            lambda: check_pipeline(PipelineConfig("zbv", virtual=2, microbatches=4), 2, 4, False, "none", compile=True),
            "schedule=zbv with `compile` is not supported",
            "--schedule zbv with --compile is not supported: a compiled block's backward is one graph, which the W "
            "pass cannot run apart from B; use --schedule 1f1b (or gpipe, interleaved-1f1b, looped-bfs), or drop "
            "--compile",
        ),
    ]
    for call, library, cli in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert library in says(e) and "--" not in says(e), says(e)
        assert cli in with_flags(says(e), TRAIN)


def _manifest() -> dict:
    return {
        "model": {"preset": "debug", "config": {"dim": 64}},
        "data": {"seq_len": 32, "global_batch": 4},
        "steps": 6,
        "step": 3,
    }


def test_a_checkpoint_that_does_not_resume_names_the_parameters():
    path = Path("ckpt")
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.check_compatible(path, _manifest(), "debug", {"dim": 64}, seq_len=16)
    assert (
        says(e) == "checkpoint ckpt was trained with seq_len=32, this run uses 16; use seq_len=32 to resume faithfully"
    )
    assert with_flags(says(e), TRAIN).endswith("; use --seq-len 32 to resume faithfully")
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.check_compatible(path, _manifest(), "small", {"dim": 256}, seq_len=32)
    assert "resume with preset=debug (" in says(e)
    assert "resume with --model debug (" in with_flags(says(e), TRAIN)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.check_compatible(path, {**_manifest(), "step": 6}, "debug", {"dim": 64}, seq_len=32, steps=6)
    assert (
        "already at steps=6: nothing left to train; start a new run from an exported checkpoint (init_from=FILE)"
        in (says(e))
    )
    assert "already at --steps 6" in with_flags(says(e), TRAIN) and "(--init-from FILE)" in with_flags(says(e), TRAIN)


def test_a_checkpoint_directory_in_use_names_checkpoint_dir(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    with pytest.raises(checkpoint.CheckpointError) as e:
        with checkpoint.directory_lock(tmp_path):
            pass
    assert says(e).startswith(f"checkpoint_dir={tmp_path} is in use by another run")
    assert with_flags(says(e), TRAIN).startswith(f"--checkpoint-dir {tmp_path} is in use by another run")


def test_token_files_name_path_and_seq_len(tmp_path):
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "none")
    assert says(e) == f"path={tmp_path / 'none'}: no such file or directory"
    assert with_flags(says(e), TRAIN) == f"--data {tmp_path / 'none'}: no such file or directory"
    # held-out files are named by the parameter that gave them
    with pytest.raises(ValueError) as e:
        TokenFileStream(tmp_path / "none", 8, 2, name="eval_data")
    assert with_flags(says(e), TRAIN) == f"--eval-data {tmp_path / 'none'}: no such file or directory"
    # what a rank finds on resume is one of tessera's errors, so the CLI prints its one line with the flags
    with pytest.raises(ConfigError) as e:
        TokenStream(16, 4).load_state_dict({"cursor": 0, "data": {"path": "/d", "tokens": 9}})
    assert with_flags(says(e), TRAIN) == "the checkpoint was trained on token files: resume with --data /d"
    assert issubclass(ConfigError, ValueError) and TokenFileStream  # callers catching ValueError still do


def test_the_planner_names_its_parameters_and_plan_says_its_flags():
    plan = subcommand_flags("plan")
    for kwargs, library, cli in [
        (dict(gpus=12), "gpus=12 is not a whole number of nodes of 8", "--gpus 12 is not a whole number"),
        (dict(gpus=8, gpu_memory_gb=0.0), "gpu_memory_gb=0.0 must be a positive", "--gpu-memory 0.0 must be"),
        (dict(gpus=8, headroom=1.0), "headroom=1.0 must be in [0, 1)", "--headroom 1.0 must be in [0, 1)"),
    ]:
        with pytest.raises(ValueError) as e:
            Hardware(**kwargs)
        assert says(e).startswith(library) and with_flags(says(e), plan).startswith(cli)
    shape = ModelShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=258, ffn_dim=192)
    why = why_not_runnable(shape, Candidate(Layout(cp=2, dp_shard=4)), 1023, 8)
    assert why == "seq_len=1023 does not split into 4 chunks for cp=2"
    assert with_flags(why, plan) == "--seq-len 1023 does not split into 4 chunks for cp=2"


def test_hugging_face_directories_are_named_by_the_parameter_that_named_them(tmp_path):
    gone = tmp_path / "gone"
    for flag, library, flags, cli in [
        ("init_from_hf", f"init_from_hf={gone}", TRAIN, f"--init-from-hf {gone}"),
        ("preset=hf:", f"preset=hf:{gone}", TRAIN, f"--model hf:{gone}"),
        ("from_hf", f"from_hf={gone}", subcommand_flags("convert"), f"--from-hf {gone}"),
    ]:
        with pytest.raises(ValueError) as e:
            read_hf_config(gone, flag=flag)
        assert says(e).startswith(f"{library}: no such directory")
        assert with_flags(says(e), flags).startswith(f"{cli}: no such directory")


# ----------------------------------------------------------------------------- the scan
LIBRARY = ("topology", "parallel", "models", "kernels")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]+")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _legitimate(tree: ast.AST) -> set[int]:
    """Strings that are a command line: an argparse help text, Candidate.flags (the `tessera train` flags
    of a planned layout)."""
    out = set()
    for node in ast.walk(tree):
        parts = []
        if isinstance(node, ast.keyword) and node.arg == "help":
            parts = [node.value]
        if isinstance(node, ast.FunctionDef) and node.name == "flags":
            parts = [node]
        for part in parts:
            out.update(id(n) for n in ast.walk(part))
    return out


def test_library_messages_spell_no_flag_but_in_a_command_line():
    """A string of the library that writes a flag is a command line (help, Candidate.flags, a `tessera ...`
    command to run), a docstring, or a message still to convert: this lists the last."""
    left = []
    for folder in LIBRARY:
        for file in sorted((ROOT / folder).glob("*.py")):
            tree = ast.parse(file.read_text())
            skip = _docstrings(tree) | _legitimate(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                    if FLAG.search(node.value) and "tessera " not in node.value:
                        left.append(f"{file.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not left, "\n".join(left)

"""--data hf:PATH[:split]: local data sets the datasets library reads (JSONL, Parquet, Arrow, save_to_disk),
streamed and tokenized on the fly. The stream equals its definition (each record's tokens and the separator,
epoch after epoch, cut into overlapping rows); every format gives the same batches; the saved position
resumes anywhere at the same tokens (hypothesis), and on other dp degrees at the same losses (dp2 -> dp4 ->
one process); a data set larger than the run is read only as far as needed; bad input and anything that
would run code is refused in one line before any rank starts."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import script_here, small_config
from tessera.data.hf_data import HFStream, parse_spec

WORDS = "the quick brown fox jumps over the lazy dog a stitch in time saves nine".split()


def documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(documents(50), trainers.BpeTrainer(vocab_size=100, special_tokens=["[UNK]", "</s>"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The same 40 documents as JSONL, Parquet, Arrow and a save_to_disk folder (train and test splits)."""
    import datasets

    root = tmp_path_factory.mktemp("hf")
    docs = documents(40)
    with open(root / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs))
    table = datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))})
    table.to_parquet(str(root / "docs.parquet"))
    datasets.DatasetDict({"train": table, "test": table.select(range(5))}).save_to_disk(str(root / "saved"))
    arrow = next(p for p in (root / "saved" / "train").iterdir() if p.suffix == ".arrow")
    return root, docs, arrow


def stream(spec, tokenizer_file, seq=16, batch=4, **kw) -> HFStream:
    return HFStream(spec, str(tokenizer_file), seq, batch, **kw)


def definition(docs, tokenizer_file, tokens: int) -> np.ndarray:
    """The global stream as written in runtime/data/hf_data.py: each document's ids and the separator, epoch
    after epoch."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    sep = tok.token_to_id("</s>")
    out: list[int] = []
    while len(out) < tokens:
        for text in docs:
            out += tok.encode(text, add_special_tokens=False).ids + [sep]
    return np.asarray(out[:tokens])


def test_every_format_streams_the_definition(data, tokenizer_file):
    root, docs, arrow = data
    seq, batch, steps = 16, 4, 30  # 30 * 64 tokens: the 40 documents (~700 tokens) about three times over
    want = definition(docs, tokenizer_file, steps * seq * batch + 1)
    for spec in (f"hf:{root}/docs.jsonl", f"hf:{root}/docs.parquet", f"hf:{arrow}", f"hf:{root}/saved:train"):
        s = stream(spec, tokenizer_file, seq, batch)
        for step in range(steps):
            inputs, targets, ends = s.next_global_batch()
            for row in range(batch):
                start = (step * batch + row) * seq
                assert inputs[row].tolist() == want[start : start + seq].tolist(), (spec, step, row)
                assert targets[row].tolist() == want[start + 1 : start + seq + 1].tolist(), (spec, step, row)
            assert torch.equal(ends, inputs == s.separator)  # plain documents end at their separator
        assert s.position["epoch"] >= 2  # wrapped around: the stream goes on from the first record


def test_a_split_of_a_saved_dataset_dict(data, tokenizer_file):
    root, docs, _ = data
    s = stream(f"hf:{root}/saved:test", tokenizer_file, 8, 2)
    want = definition(docs[:5], tokenizer_file, 8 * 2 * 20 + 1)
    got = [s.next_global_batch()[0] for _ in range(20)]
    assert torch.cat(got).flatten().tolist() == want[:-1].reshape(-1, 8).flatten().tolist()
    assert parse_spec("hf:a/b:test") == (parse_spec("hf:a/b")[0], "test")


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(before=st.integers(0, 25), seq=st.sampled_from([5, 16, 33]), batch=st.sampled_from([1, 2, 4]))
def test_a_resumed_stream_reads_what_the_uninterrupted_one_does(data, tokenizer_file, before, seq, batch):
    root, _, _ = data
    spec = f"hf:{root}/docs.jsonl"
    straight = stream(spec, tokenizer_file, seq, batch)
    interrupted = stream(spec, tokenizer_file, seq, batch)
    for _ in range(before):
        straight.next_global_batch()
        interrupted.next_global_batch()
    state = json.loads(json.dumps(interrupted.state_dict()))  # as the checkpoint stores it
    resumed = stream(spec, tokenizer_file, seq, batch)
    resumed.load_state_dict(state)
    for _ in range(6):
        for a, b in zip(straight.next_global_batch(), resumed.next_global_batch()):
            assert torch.equal(a, b)
    assert resumed.documents_read <= straight.documents_read  # the skipped records are not tokenized


def _train(config, sums=None):
    from tessera.training.run import train

    history = train(config)
    if sums is not None:
        sums.extend(r["tokens_checksum"] for r in history)
    return [r["loss"] for r in history]


def test_resume_dp2_to_dp4_to_one_process_equals_the_uninterrupted_run(data, tokenizer_file, tmp_path):
    root, _, _ = data
    common = dict(data=f"hf:{root}/docs.jsonl", tokenizer=str(tokenizer_file), vocab_size=258, seq_len=16)
    common.update(global_batch=4, steps=6, n_layers=2)
    straight_sums: list[int] = []
    straight = _train(small_config(**common), straight_sums)
    assert len(set(straight_sums)) == 6  # a new batch each step
    a, b, sums = tmp_path / "a", tmp_path / "b", [[], [], []]
    first = _train(small_config(**common, dp=2, checkpoint_dir=str(a), checkpoint_every=2), sums[0])
    second = _train(
        small_config(**common, dp=4, resume=str(a / "step_00000002"), checkpoint_dir=str(b), checkpoint_every=2),
        sums[1],
    )
    third = _train(small_config(**common, resume=str(b / "step_00000004")), sums[2])
    assert sums[0][:2] + sums[1][:2] + sums[2] == straight_sums  # the same tokens, step for step
    # resuming it on other data is refused before any rank starts, naming what it was trained on
    step2 = str(a / "step_00000002")
    with pytest.raises(ValueError, match=r"was trained on hf:\S+docs.jsonl, and this run reads the shipped text"):
        small_config(**dict(common, data=None, tokenizer=None), resume=step2).check()
    other = tmp_path / "other"  # the same tokenizer, another separator (its eos_token)
    other.mkdir()
    (other / "tokenizer.json").write_text(tokenizer_file.read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[UNK]"}))
    with pytest.raises(ValueError, match=r"with separator=1 \(this run: separator=0\); resume with the same data"):
        small_config(**dict(common, tokenizer=str(other)), resume=step2).check()
    resumed = first[:2] + second[:2] + third
    assert len(resumed) == 6
    for got, want in zip(resumed, straight):
        assert abs(got - want) <= 1e-5 * want, (resumed, straight)


def test_a_data_set_larger_than_the_run_is_read_only_as_far_as_needed(tmp_path, tokenizer_file):
    """~60 MB of JSONL; two steps of 4 x 64 tokens read a few documents, and memory does not grow with the file."""
    path = tmp_path / "big.jsonl"
    line = json.dumps({"text": " ".join(WORDS * 2)}) + "\n"
    with open(path, "w") as f:
        f.write(line * (60_000_000 // len(line)))
    records = 60_000_000 // len(line)

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    s = stream(f"hf:{path}", tokenizer_file, 64, 4)
    before = rss()
    for _ in range(2):
        s.next_global_batch()
    grown = rss() - before
    assert s.documents_read < 40 and records > 100_000  # 2 * 256 tokens: a few 30-token documents
    assert grown < 30_000_000, f"reading two batches grew the process by {grown / 1e6:.0f} MB for a 60 MB file"


def test_bad_input_is_one_line_before_any_rank(data, tokenizer_file, tmp_path, refused):
    root, _, _ = data
    tok = ["--tokenizer", str(tokenizer_file), "--vocab-size", "100"]
    jsonl = f"hf:{root}/docs.jsonl"
    assert "no text field 'body' (its fields: id, text)" in refused("--data", jsonl, "--text-field", "body", *tok)
    assert "no split 'valid'; its splits: train, test" in refused("--data", f"hf:{root}/saved:valid", *tok)
    assert "no split 'valid'; its split: train" in refused("--data", f"hf:{root}/docs.jsonl:valid", *tok)
    files = tmp_path / "files"
    files.mkdir()
    for split in ("train", "test"):
        (files / f"{split}.jsonl").write_text((root / "docs.jsonl").read_text())
    assert "Bad split: valid. Available splits: ['train', 'test']" in refused("--data", f"hf:{files}:valid", *tok)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size()
    line = refused("--data", jsonl, "--tokenizer", str(tokenizer_file), "--vocab-size", "30")
    assert f"its vocabulary of {vocab} exceeds the model's 30; add --vocab-size {vocab}" in line
    assert "needs --tokenizer" in refused("--data", jsonl)
    assert "--tokenizer applies to hf: data" in refused(*tok)
    assert "no such file or directory" in refused("--data", f"hf:{tmp_path}/none.jsonl", *tok)
    # issue 65 item 10: "datasets cannot read it (StopIteration)" and "JSON parse error: ... in row 1" alone
    (tmp_path / "empty.jsonl").write_text("")
    assert f"--data hf:{tmp_path}/empty.jsonl holds no records (an empty file)" in refused(
        "--data", f"hf:{tmp_path}/empty.jsonl", *tok
    )
    (tmp_path / "cut.jsonl").write_text('{"text": "a whole line"}\n{"text": "a string left open}\n')
    line = refused("--data", f"hf:{tmp_path}/cut.jsonl", *tok)
    assert f"--data hf:{tmp_path}/cut.jsonl: cannot be read (" in line and "a string left open?" in line, line
    assert "--sft reads records with 'messages'" in refused("--data", jsonl, "--sft", *tok)
    (tmp_path / "notckpt").mkdir()
    line = refused("--data", jsonl, *tok, "--resume", str(tmp_path / "notckpt"))
    assert "notckpt: not a tessera checkpoint" in line


def test_loading_scripts_are_refused_by_name(data, tokenizer_file, tmp_path, refused):
    root, _, _ = data
    folder = tmp_path / "scripted"
    folder.mkdir()
    (folder / "train.jsonl").write_text((root / "docs.jsonl").read_text())
    (folder / "scripted.py").write_text("import os; os.system('touch pwned')\n")
    tok = ["--tokenizer", str(tokenizer_file), "--vocab-size", "100"]
    line = refused("--data", f"hf:{folder}", *tok)
    assert "scripted.py is a data set loading script, which runs code (trust_remote_code)" in line
    assert "loading script" in refused("--data", f"hf:{folder}/scripted.py", *tok)
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")


def test_without_the_datasets_library_the_line_names_the_extra(data, tokenizer_file, monkeypatch):
    import sys

    from tessera.topology.errors import ConfigError

    root, _, _ = data
    monkeypatch.setitem(sys.modules, "datasets", None)  # an import of it raises ImportError
    with pytest.raises(
        ConfigError,
        match=r'path=hf:\.\.\. needs the datasets library: pip install -e "\.\[data\]" in the tessera clone',
    ):
        stream(f"hf:{root}/docs.jsonl", tokenizer_file)


def test_held_out_hf_data_gives_the_same_eval_loss_on_dp2_as_on_one_process(data, tokenizer_file):
    root, _, _ = data
    common = dict(data=f"hf:{root}/docs.jsonl", tokenizer=str(tokenizer_file), vocab_size=100, seq_len=16)
    common.update(global_batch=4, steps=2, n_layers=2, eval_data=f"hf:{root}/saved:test", eval_every=2)
    from tessera.training.run import train

    one, two = (train(small_config(**common, **kw))[-1]["eval_loss"] for kw in ({}, {"dp": 2}))
    assert abs(one - two) <= 1e-5 * one


def test_the_benchmark_runs_on_a_tiny_setting(tmp_path):
    """benchmarks/bench_hf_data.py on a tiny setting: both rows, each with its data and step times."""

    tiny = ["--model", "debug", "--seq-len", "16", "--global-batch", "4", "--steps", "1", "--warmup", "1"]
    out = script_here("bench_hf_data", *tiny, "--records", "50", "--vocab", "300", "--out", str(tmp_path / "h.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "h.json").read_text())
    assert data["versions"]["torch"] and data["config"]["model"] == "debug"
    rows = data["results"]["rows"]
    assert [r["data"] for r in rows] == ["shipped text", "hf: streamed"]
    assert all(0 < r["data_s"] < r["step_s"] for r in rows)


def test_local_data_never_reaches_the_network(data, tokenizer_file, tmp_path, monkeypatch):
    """A FIFO given as hf:fifo.jsonl made five requests to the Hub before failing (datasets took the name for a
    hub data set): it is refused in one line, and every local format streams with the network refused."""
    import socket

    from tessera.topology.errors import ConfigError

    attempts = []

    def refused_connect(self, address):
        attempts.append(address)
        raise OSError("the network is refused in this test")

    monkeypatch.setattr(socket.socket, "connect", refused_connect)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: refused_connect(None, a[0]))
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"fifo\.jsonl is not a regular file or a directory \(a pipe or a device\)"):
        stream(f"hf:{fifo}", tokenizer_file)
    root, docs, arrow = data
    files = tmp_path / "files"  # a folder of data files: the path datasets resolves itself
    files.mkdir()
    (files / "train.jsonl").write_text((root / "docs.jsonl").read_text())
    for spec in (f"hf:{root}/docs.jsonl", f"hf:{root}/docs.parquet", f"hf:{arrow}", f"hf:{root}/saved", f"hf:{files}"):
        stream(spec, tokenizer_file, 8, 2).next_global_batch()
    assert attempts == []

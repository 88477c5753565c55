"""Token files: `tessera tokenize` with a tokenizer made here, `--data` on any layout equal to one process,
resuming on another layout at the same tokens, and bad files named."""

import json

import numpy as np
import pytest
import torch

from helpers import small_config
from tessera.data.tokens import TokenFileStream, open_dataset, write_shard

TEXT = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. " * 40).split(". ")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "</s>"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def data_dir(tokenizer_file, tmp_path_factory):
    from tessera.cli import main

    src = tmp_path_factory.mktemp("src")
    (src / "a.txt").write_text(" ".join(TEXT[:30]))
    (src / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXT[30:]) + "\n")
    out = tmp_path_factory.mktemp("data") / "tokens"
    assert (
        main(
            [
                "tokenize",
                "--tokenizer",
                str(tokenizer_file),
                "--out",
                str(out),
                "--shard-tokens",
                "300",
                "--quiet",
                str(src / "a.txt"),
                str(src / "b.jsonl"),
            ]
        )
        == 0
    )
    return out


def test_tokenize_writes_shards_that_decode_back_to_the_documents(data_dir, tokenizer_file):
    from tokenizers import Tokenizer

    shards = open_dataset(data_dir)
    assert len(shards) > 1 and all(s.tokens.dtype == np.uint16 for s in shards)  # 300-token shards
    ids = np.concatenate([np.asarray(s.tokens) for s in shards]).tolist()
    tok = Tokenizer.from_file(str(tokenizer_file))
    sep = tok.token_to_id("</s>")
    assert shards[0].separator == sep and ids.count(sep) == 1 + len(TEXT[30:])  # one per document
    first = ids[: ids.index(sep)]
    assert tok.decode(first).split() == " ".join(TEXT[:30]).replace(".", " .").split()


def test_a_dp_rank_reads_only_its_rows_and_they_tile_the_global_batch(data_dir):
    for dp in (1, 2, 4):
        streams = [TokenFileStream(data_dir, 16, 4) for _ in range(dp)]
        for step in range(3):
            whole = streams[0].global_batch_at(step * 4)
            parts = [s.next_local_batch(i, dp) for i, s in enumerate(streams)]
            assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
            assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
            assert parts[0][2] == 4 * 16


def _losses(config, checksums=None):
    from tessera.training.run import train

    history = train(config)
    if checksums is not None:
        checksums.extend(r["tokens_checksum"] for r in history)
    return [(r["loss"], r["grad_norm"]) for r in history]


def test_token_files_train_equally_on_dp2xtp2_and_one_process_and_resume_on_another_layout(data_dir, tmp_path):
    common = dict(data=str(data_dir), vocab_size=120, seq_len=16, global_batch=4, steps=6)
    sums_one, sums_spread, sums_resumed, sums_cp = [], [], [], []
    one = _losses(small_config(**common), sums_one)
    spread = _losses(small_config(**common, dp=2, tp=2), sums_spread)
    _losses(small_config(**common, dp=2, cp=2), sums_cp)
    assert sums_one == sums_spread == sums_cp and len(set(sums_one)) == 6  # the same tokens, a new batch each step
    for (l1, g1), (l2, g2) in zip(one, spread):
        assert abs(l1 - l2) <= 1e-5 * l1 and abs(g1 - g2) <= 1e-5 * g1
    # saved at step 3 on tp2, resumed from there on dp2: the data cursor carries over, the steps match the straight run
    ckpt = tmp_path / "ckpt"
    _losses(small_config(**common, tp=2, checkpoint_dir=str(ckpt), checkpoint_every=3))
    resumed = _losses(small_config(**common, dp=2, resume=str(ckpt / "step_00000003")), sums_resumed)
    assert sums_resumed == sums_one[3:]  # token checksums per step: the resumed run reads what the straight one did
    assert len(resumed) == 3
    for (l1, g1), (l2, g2) in zip(one[3:], resumed):
        assert abs(l1 - l2) <= 1e-5 * l1 and abs(g1 - g2) <= 1e-5 * g1


def test_bad_token_files_are_named(tmp_path, data_dir):
    # a token id beyond the vocabulary (the sidecar claims a smaller one than the ids use)
    path = write_shard(tmp_path / "bad", [1, 2, 3, 99] * 20, vocab_size=100, separator=0)
    meta = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps({**meta, "vocab_size": 50}))
    with pytest.raises(
        ValueError, match=r"path=.*bad\.bin: token id 99 near token \d+ is outside the vocabulary of 50"
    ):
        TokenFileStream(path, 8, 2).next_local_batch(0, 1)
    # a truncated file
    cut = write_shard(tmp_path / "cut", list(range(40)), vocab_size=100, separator=0)
    cut.write_bytes(cut.read_bytes()[:-6])
    with pytest.raises(
        ValueError,
        match=r"cut\.bin is truncated or altered: 74 bytes, its cut\.json says 40 uint16 tokens \(80 bytes\)",
    ):
        open_dataset(cut)
    # no sidecar, an empty directory, a missing path
    (tmp_path / "lonely.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="no lonely.json beside it"):
        open_dataset(tmp_path / "lonely.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .bin token files"):
        open_dataset(tmp_path / "empty")


def test_the_vocabulary_check_and_the_data_source_switch_are_refused(data_dir, tmp_path):
    big = write_shard(tmp_path / "big", [5, 300, 7] * 10, vocab_size=400, separator=0)
    with pytest.raises(
        ValueError, match=r"--data .*big\.bin: its vocab_size 400 exceeds the debug model's 258; add --vocab-size 400"
    ):
        small_config(data=str(big), seq_len=8).check()
    with pytest.raises(ValueError, match="--vocab-size 1 must be at least 2"):
        small_config(vocab_size=1).check()
    # a checkpoint of the shipped text does not resume on token files, nor the reverse
    stream = TokenFileStream(data_dir, 16, 4)
    with pytest.raises(ValueError, match="trained on the text shipped with tessera"):
        stream.load_state_dict({"cursor": 8, "seq_len": 16, "global_batch": 4})
    from tessera.data.corpus import TokenStream

    with pytest.raises(ValueError, match="trained on token files"):
        TokenStream(16, 4).load_state_dict(stream.state_dict())


def test_tokenize_refuses_bad_input_with_one_line(tmp_path, tokenizer_file, capsys):
    from tessera.cli import main

    (tmp_path / "x.jsonl").write_text('{"body": "no text field"}\n')
    assert (
        main(["tokenize", "--tokenizer", str(tokenizer_file), "--out", str(tmp_path / "o"), str(tmp_path / "x.jsonl")])
        == 2
    )
    assert "x.jsonl:1: no string field 'text'; pass --field NAME" in capsys.readouterr().err
    assert (
        main(
            [
                "tokenize",
                "--tokenizer",
                str(tmp_path / "nope.json"),
                "--out",
                str(tmp_path / "o"),
                str(tmp_path / "x.jsonl"),
            ]
        )
        == 2
    )
    assert "--tokenizer" in capsys.readouterr().err
    assert (
        main(
            [
                "tokenize",
                "--tokenizer",
                str(tokenizer_file),
                "--separator",
                "<nope>",
                "--out",
                str(tmp_path / "o"),
                str(tmp_path / "x.jsonl"),
            ]
        )
        == 2
    )
    assert "--separator '<nope>' is not a token" in capsys.readouterr().err


def test_eval_every_reports_the_held_out_loss_equally_on_every_layout(data_dir, tmp_path):
    from tessera.training.run import train

    common = dict(
        data=str(data_dir),
        eval_data=str(data_dir),
        eval_every=2,
        eval_batches=2,
        vocab_size=120,
        seq_len=16,
        global_batch=4,
        steps=4,
    )
    one = train(small_config(**common))
    assert [("eval_loss" in r) for r in one] == [False, True, False, True]
    # a pipeline evaluates through its stages too, with the microbatches the schedule chose (--pp alone)
    for layout in (dict(dp=2, tp=2), dict(pp=2, dp=2), dict(pp=2, schedule="interleaved-1f1b", virtual=2, n_layers=4)):
        spread = train(small_config(**common, **layout))
        reference = one if "n_layers" not in layout else train(small_config(**common, n_layers=4))
        for a, b in zip(reference, spread):
            if "eval_loss" in a:
                assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5 * a["eval_loss"], (layout, a, b)
    assert one[3]["eval_loss"] < one[1]["eval_loss"]  # the same held-out batches, after two more steps


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(eval_every=2), "--eval-every 2 needs --eval-data PATH"),
        (dict(eval_data="x"), "--eval-data x is read only with --eval-every N"),
        (dict(eval_every=-1), "--eval-every -1 must be >= 0"),
        (dict(eval_every=2, eval_data="/nonexistent/held-out"), "--eval-data /nonexistent/held-out: no such file"),
    ],
)
def test_eval_flags_that_would_do_nothing_or_cannot_run_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        small_config(**overrides).check()

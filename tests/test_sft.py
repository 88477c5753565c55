"""--sft: records with `messages` or `prompt` and `response`, rendered with the model folder's chat template
(else the plain one) in jinja2's sandbox, the loss on the assistant's tokens only. The kept targets are
exactly each assistant turn's tokens; a packed SFT batch equals each example run alone (per-token losses and
gradients, 1e-5) on one process, dp2 x tp2 and cp2; the step records count the targets kept and masked; a
template that reaches for Python objects is refused."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from packing import SEED, build_small, one_process_model, run_alone

from helpers import cli_here, small_config
from tessera.data.chat import ChatRenderer, messages_of
from tessera.data.corpus import IGNORE_INDEX, pack_documents
from tessera.data.hf_data import HFStream
from tessera.models.spec import get_spec
from tessera.launching.launch import run_ranks
from tessera.testing import RunSpec, compare_runs, train_spec_on_layout
from tessera.topology import Layout

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = "what is the capital of france paris is it is a city in europe yes no maybe tell me more".split()
S, G = 32, 4


def sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


RECORDS = [
    {"messages": [{"role": "user", "content": sentence(0, 5)}, {"role": "assistant", "content": sentence(1, 4)}]},
    {"prompt": sentence(2, 3), "response": sentence(3, 6)},
    {
        "messages": [
            {"role": "system", "content": sentence(4, 2)},
            {"role": "user", "content": sentence(5, 4)},
            {"role": "assistant", "content": sentence(6, 3)},
            {"role": "user", "content": sentence(7, 2)},
            {"role": "assistant", "content": sentence(8, 5)},
        ]
    },
    {"prompt": sentence(9, 12), "response": sentence(10, 2)},
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(a model folder with a chat template, one without, the records as JSONL)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("sft")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "</s>", "<|im_start|>", "<|im_end|>", "###"]
    tok.train_from_iterator(
        [" ".join(WORDS)] * 10 + ["user assistant system"], trainers.BpeTrainer(vocab_size=90, special_tokens=specials)
    )
    chat, plain = root / "chat", root / "plain"
    for folder in (chat, plain):
        folder.mkdir()
        tok.save(str(folder / "tokenizer.json"))
    (chat / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>"}))
    with open(root / "sft.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in RECORDS * 3)
    return chat, plain, root / "sft.jsonl"


@pytest.mark.parametrize("templated", [True, False], ids=["chat-template", "plain"])
def test_the_kept_targets_are_the_assistant_turns_exactly(folders, templated):
    chat, plain, records = folders
    s = HFStream(f"hf:{records}", str(chat if templated else plain), S, G, sft=True)
    assert isinstance(s.renderer, ChatRenderer)
    tok = s.tok.tokenizer
    closing = "<|im_end|>" if templated else ""  # the turn's closing text; newlines are whitespace to this tokenizer
    for i, record in enumerate(RECORDS):
        ids, keep = s.encode(record, f"record {i}")
        kept = [t for t, k in zip(ids.tolist(), keep.tolist()) if k]
        want: list[int] = []
        for turn in messages_of(record, ""):
            if turn["role"] == "assistant":
                want += tok.encode(turn["content"] + closing, add_special_tokens=False).ids
        assert kept == want + [s.separator], i  # and the separator that ends the example
        text = tok.decode(ids.tolist(), skip_special_tokens=False)
        assert ("<|im_start|>" in text) == templated and ("###" in text) != templated


def packed_sft_batch(folders):
    chat, _, records = folders
    s = HFStream(f"hf:{records}", str(chat), S, G, sft=True)
    inputs, targets, ends = s.next_global_batch()
    targets, positions = pack_documents(inputs, targets, s.separator, ends)
    return inputs, targets, positions


def test_a_packed_sft_batch_equals_each_example_alone_on_one_process(folders):
    inputs, targets, positions = packed_sft_batch(folders)
    assert (targets == IGNORE_INDEX).float().mean() > 0.3 and (positions == 0).sum() > G  # masks, several examples
    model = one_process_model()
    alone, alone_grads = run_alone(model, inputs, targets, positions)
    model.zero_grad(set_to_none=True)
    logits = model(inputs, positions)
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(targets.shape)
    (per_token.sum() / (targets != IGNORE_INDEX).sum()).backward()
    torch.testing.assert_close(per_token.detach(), alone, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, alone_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_a_packed_sft_batch_equals_each_example_alone_on_dp2xtp2_and_cp2(folders):
    batch = packed_sft_batch(folders)
    model = one_process_model()
    _, grads = run_alone(model, *batch)
    with torch.no_grad():
        logits = model(batch[0], batch[2])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[1].flatten(), ignore_index=IGNORE_INDEX)
    reference = {"losses": [loss.item()], "grads": [grads]}
    for layout in (Layout(dp_shard=2, tp=2), Layout(cp=2)):
        spec = RunSpec(build_small, layout, None, batch, 1, 0.1, SEED, None, "FULL_SHARD", get_spec("llama"))
        run = run_ranks(train_spec_on_layout, layout.world_size, spec, timeout=180)[0]
        compare_runs(reference, run, f"a packed SFT batch on {layout}", rtol=1e-5)


def test_sft_training_records_the_targets_kept_and_masked(folders):
    from tessera.training.run import train

    chat, _, records = folders
    common = dict(data=f"hf:{records}", tokenizer=str(chat), sft=True, seq_len=S, global_batch=G, steps=2)
    history = train(small_config(**common, pack_documents=True, dp=2))
    s = HFStream(f"hf:{records}", str(chat), S, G, sft=True)
    for record in history:
        inputs, targets, ends = s.next_global_batch()
        prompts = int((targets == IGNORE_INDEX).sum())
        packed, _ = pack_documents(inputs, targets, s.separator, ends)  # also leaves out each example's last target
        kept = int((packed != IGNORE_INDEX).sum())
        assert 0 < kept <= S * G - prompts  # (a separator's target, the next prompt's first, is masked already)
        assert record["loss_targets"] == {"kept": kept, "masked": S * G - kept}
        assert record["documents"]["targets_left_out"] == S * G - kept


def test_a_template_that_reaches_for_python_objects_is_refused(folders, tmp_path, refused):
    chat, _, records = folders
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "tokenizer.json").write_text((chat / "tokenizer.json").read_text())
    template = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (evil / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    line = refused("--data", f"hf:{records}", "--tokenizer", str(evil), "--sft")
    assert "the chat template was refused: it reaches for Python objects" in line
    assert "sandbox" in line


@pytest.mark.parametrize(
    "template, said",
    [
        ("", "renders none of the assistant's words"),  # an empty template: separators alone were trained on
        ("{% for m in messages %}{{ m.content.__class__ }}{% endfor %}", "reaches for Python objects"),
        ("{% for m in messages %}{{ m['text'] }}{% endfor %}", "failed to render"),  # an undefined field
        ("{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}", "'greeting' is undefined"),
    ],
)
def test_a_template_that_renders_nothing_or_an_undefined_is_refused(folders, tmp_path, refused, template, said):
    """Issue 65 item 5: these trained on separators only (`loss_targets {'kept': 512, 'masked': 0}`) with no
    warning; the sandbox's undefined printed as nothing."""
    chat, _, records = folders
    folder = tmp_path / "template"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((chat / "tokenizer.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    line = refused("--data", f"hf:{records}", "--tokenizer", str(folder), "--sft")
    assert said in line, line


def test_the_start_up_line_names_the_data_and_the_template(folders, tmp_path):
    """Issue 65 item 12: the start-up line named neither the data source nor whether SFT used the folder's
    template (nor the optimizer when it is Muon)."""
    chat, _, records = folders
    base = ["train", "--data", f"hf:{records}", "--tokenizer", str(chat), "--sft", "--steps", "1", "--seq-len", "32"]
    base += ["--global-batch", "2", "--vocab-size", "90"]
    out = cli_here(*base, "--optimizer", "muon")
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert f"data: hf:{records} (SFT with the chat template: the loss on the assistant's tokens)" in first, first
    assert "Muon on the hidden matrices, AdamW on the rest" in first

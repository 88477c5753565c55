"""`tessera generate` and its KV cache: decoding with the cache equals recomputing the whole prefix at every
step (fp32 logits within 1e-5) for every family; greedy tokens equal transformers' `generate` on the exported
model on one process and on tp2 ranks; a checkpoint `tessera train` wrote generates the same text on one
process and on tp2 ranks; top-p keeps the smallest most likely set of its mass."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import cli_here

from tessera.cli import main
from tessera.models.generation import Sampling, generate, top_p_filter
from tessera.models.kv_cache import KVCache, cache_slots, kv_caches
from tessera.models.spec import get_preset

FAMILIES = {"llama": "debug", "qwen3": "qwen3-debug", "qwen3_moe": "qwen3-moe-debug"}
PROMPT = (256, 84, 104, 101, 32, 113, 117)  # BOS "The qu" in the debug presets' byte vocabulary
NEW = 12


def _decisive(cfg, seed: int = 0) -> torch.nn.Module:
    """A model of `cfg` with weights large enough that its logits (and an MoE's routing) differ clearly
    between tokens, so a wrong position or mask changes the tokens, not only the last digits."""
    from tessera.models.spec import spec_of

    model = spec_of(cfg).build_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


# ----------------------------------------------------------------------------- the sampler
@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=12).filter(lambda w: sum(w) > 1e-3),
    st.floats(0.01, 1.0),
)
def test_top_p_keeps_the_smallest_most_likely_set_that_reaches_p(weights, top_p):
    probs = torch.tensor(weights, dtype=torch.float64)
    probs = probs / probs.sum()
    kept = top_p_filter(probs, top_p)
    assert torch.isclose(kept.sum(), torch.tensor(1.0, dtype=torch.float64))
    inside = kept > 0
    assert inside.any()
    # every kept token is at least as likely as every dropped one, and the kept ones keep their proportions
    dropped = ~inside & (probs > 0)
    if dropped.any():
        assert probs[inside].min() >= probs[dropped].max()
    assert torch.allclose(kept[inside], probs[inside] / probs[inside].sum())
    # the set reaches top_p, and without its least likely member it would not (ties broken by token id)
    order = sorted(range(len(weights)), key=lambda i: (-probs[i].item(), i))
    n = int(inside.sum())
    assert set(order[:n]) == set(inside.nonzero().flatten().tolist())
    assert probs[order[:n]].sum() >= top_p - 1e-12 or n == len(weights)
    # (1e-12: the filter's cumulative sum and this sum round differently; a mass within rounding of 1 at top_p 1)
    assert n == 1 or probs[order[: n - 1]].sum() < top_p + 1e-12


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.5, float("nan")])
def test_a_top_p_outside_zero_to_one_is_refused_by_name(top_p):
    with pytest.raises(ValueError, match=r"top_p=.* is outside \(0, 1\]"):
        Sampling(temperature=0.7, top_p=top_p)


# ----------------------------------------------------------------------------- the cache
# every family's debug preset, and Qwen3-MoE's other recipe (sigmoid scores, a shared expert, the routing bias)
@pytest.mark.parametrize("preset", [*FAMILIES.values(), "qwen3-moe-shared-debug"])
def test_decoding_with_the_kv_cache_equals_recomputing_the_whole_prefix(preset):
    model = _decisive(get_preset(preset))
    prompt = torch.tensor([PROMPT, tuple(reversed(PROMPT))])  # two rows: the cache keeps them apart
    cached = generate(model, prompt, NEW, keep_logits=True)
    full = generate(model, prompt, NEW, use_cache=False, keep_logits=True)
    assert cached.tokens == full.tokens and len(cached.logits) == NEW
    for step, (a, b) in enumerate(zip(cached.logits, full.logits)):
        err = (a - b).abs().max().item()
        assert err <= 1e-5 * max(1.0, b.abs().max().item()), (preset, step, err)
    assert len(set(cached.tokens[0])) > 1  # not one token repeated: the positions matter here
    sampling = Sampling(temperature=0.9, top_p=0.8, seed=5)
    assert generate(model, prompt, NEW, sampling).tokens == generate(model, prompt, NEW, sampling, False).tokens


def test_a_wrong_position_would_be_caught():
    """The cache test can fail: the same cached decoding with RoPE one position off gives other logits."""
    from tessera.models.kv_cache import next_positions

    model = _decisive(get_preset("debug"))
    prompt = torch.tensor([PROMPT])
    with torch.no_grad(), kv_caches(model, len(PROMPT) + 1) as caches:
        model(prompt, torch.arange(len(PROMPT)))
        right = next_positions(caches, 1, "cpu")
        step = model(torch.tensor([[97]]), right)[:, -1]
    with torch.no_grad():
        full = model(torch.tensor([[*PROMPT, 97]]))[:, -1]
    with torch.no_grad(), kv_caches(model, len(PROMPT) + 1):
        model(prompt, torch.arange(len(PROMPT)))
        shifted = model(torch.tensor([[97]]), right + 1)[:, -1]
    assert (step - full).abs().max() <= 1e-5 * full.abs().max()
    assert (shifted - full).abs().max() > 1e-3 * full.abs().max()


def test_the_cache_changes_no_parameter_or_state_dict_and_leaves_with_the_block():
    model = _decisive(get_preset("qwen3-debug"))
    before = dict(model.state_dict())
    slots = cache_slots(model)
    assert len(slots) == 2  # one per layer's attention
    with kv_caches(model, 8) as caches:
        assert all(s.kv_cache is c for s, c in zip(slots, caches))
        assert model.state_dict().keys() == before.keys()
    assert all(s.kv_cache is None for s in slots)
    cache = KVCache(3)
    k = torch.zeros(1, 2, 2, 4)
    cache(k, k)
    with pytest.raises(ValueError, match="holds 3 positions; writing 2 after 2"):
        cache(k, k)


# ----------------------------------------------------------------------------- against transformers
@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each family's debug preset with decisive weights, exported as a Hugging Face folder."""
    from tessera.models.hf import save_hf

    out = {}
    for family, preset in FAMILIES.items():
        cfg = get_preset(preset)
        path = tmp_path_factory.mktemp(family)
        save_hf(_decisive(cfg, seed=3).state_dict(), cfg, path)
        out[family] = path
    return out


def _transformers_greedy(path, new: int = NEW) -> list[int]:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(PROMPT) :].tolist()


def _generate_json(capsys, *argv) -> dict:
    code = main(["generate", *argv, "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _ids(prompt=PROMPT) -> str:
    return ",".join(map(str, prompt))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate_on_the_exported_model(capsys, hf_dirs, family):
    want = _transformers_greedy(hf_dirs[family])
    got = _generate_json(
        capsys, "--checkpoint", f"hf:{hf_dirs[family]}", "--prompt-ids", _ids(), "--max-new-tokens", "12"
    )
    assert got["tokens"] == want and len(set(want)) > 1, (family, got["tokens"], want)
    assert got["compute_dtype"] == "float32" and got["new_tokens"] == NEW and got["tokens_per_s"] > 0


def test_the_folders_tokenizer_and_eos_are_used_as_transformers_uses_them(capsys, hf_dirs, tmp_path):
    """hf:DIR with a tokenizer.json and a generation_config.json: the prompt text is the tokenizer's ids, and
    generation stops at the folder's eos_token_id (included), as transformers' generate does."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path / "llama"
    shutil.copytree(hf_dirs["llama"], folder)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainers.BpeTrainer(vocab_size=60))
    tok.save(str(folder / "tokenizer.json"))
    prompt = tok.encode("the quick brown fox").ids
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    kwargs = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        free = theirs.generate(torch.tensor([prompt]), eos_token_id=None, **kwargs)[0, len(prompt) :].tolist()
        eos = free[4]  # a token it reaches: generation ends there
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 10_000]}))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        want = theirs.generate(torch.tensor([prompt]), **kwargs)[0, len(prompt) :].tolist()
    got = _generate_json(
        capsys, "--checkpoint", f"hf:{folder}", "--prompt", "the quick brown fox", "--max-new-tokens", "12"
    )
    assert got["prompt_ids"] == prompt and got["tokens"] == want == free[: free.index(eos) + 1] and got["stopped"]
    assert got["text"] == tok.decode(want, skip_special_tokens=True)


def test_a_checkpoint_names_the_tokenizer_its_run_used():
    from tessera.commands.generate import training_tokenizer

    def manifest(tokenizer=None, init_from_hf=None, preset="debug"):
        config = {"data": {"tokenizer": tokenizer}, "checkpoint": {"init_from_hf": init_from_hf}}
        return {"config": config, "model": {"preset": preset}}

    assert training_tokenizer(manifest("tok.json", "llama/")) == "tok.json"
    assert training_tokenizer(manifest(None, "llama/")) == "llama/"
    assert training_tokenizer(manifest(preset="hf:qwen/")) == "qwen/"
    assert training_tokenizer(manifest()) is None and training_tokenizer({}) is None


def test_bfloat16_weights_run_bfloat16_matmuls_as_measured(capsys, hf_dirs):
    got = _generate_json(
        capsys, "--checkpoint", f"hf:{hf_dirs['qwen3']}", "--prompt-ids", _ids(), "--dtype", "bfloat16"
    )
    assert got["compute_dtype"] == "bfloat16" and got["weights_dtype"] == "bfloat16" and len(got["tokens"]) == 32
    from tessera.commands.generate import _cast_parameters

    model = _cast_parameters(_decisive(get_preset("qwen3-moe-shared-debug")), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # RoPE's tables and the routing bias stay float32, as training's mixed precision keeps them
    assert {b.dtype for b in model.buffers()} == {torch.float32} and model.rope.cos.dtype == torch.float32


def _on_tp_ranks(jobs):
    """Rank function: every job on this tp mesh, rank 0's results."""
    import torch.distributed as dist

    from tessera.commands.generate import run
    from tessera.topology import Layout, Meshes

    meshes = Meshes(Layout(tp=dist.get_world_size()), "cpu")
    return [run(job, meshes, dist.get_rank()) for job in jobs]


def _job(checkpoint: str, tp: int = 2):
    import argparse

    from tessera.commands.generate import add_generate_parser, preflight

    sub = argparse.ArgumentParser().add_subparsers()
    add_generate_parser(sub)
    args = sub.choices["generate"].parse_args(
        ["--checkpoint", checkpoint, "--prompt-ids", _ids(), "--max-new-tokens", str(NEW), "--tp", str(tp), "--quiet"]
    )
    return preflight(args)[0]


def test_greedy_tokens_equal_transformers_on_tp2_ranks_for_every_family(capsys, hf_dirs):
    from tessera.launching.launch import run_ranks

    jobs = [_job(f"hf:{hf_dirs[f]}") for f in FAMILIES]
    results = run_ranks(_on_tp_ranks, 2, jobs, timeout=180)[0]
    for family, result in zip(FAMILIES, results):
        assert result["tokens"] == _transformers_greedy(hf_dirs[family]), family


# ----------------------------------------------------------------------------- a trained checkpoint, end to end
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint of the debug preset after a few steps of `tessera train` on tp2 (its shards are cut
    otherwise than one process's and tp2's generation read them)."""
    root = tmp_path_factory.mktemp("trained")
    argv = ["train", "--model", "debug", "--steps", "4", "--seq-len", "64", "--global-batch", "4", "--tp", "2"]
    argv += ["--lr", "3e-3", "--checkpoint-dir", str(root / "ckpt"), "--checkpoint-every", "4", "--quiet"]
    assert main(argv) == 0
    return root / "ckpt"


def test_a_trained_checkpoint_generates_the_same_text_on_one_process_and_tp2_ranks(capsys, trained):
    one = _generate_json(capsys, "--checkpoint", str(trained), "--prompt", "The ", "--max-new-tokens", "20")
    assert one["family"] == "llama" and one["prompt_ids"] == [256, 84, 104, 101, 32] and one["new_tokens"] == 20
    proc = cli_here("generate", "--checkpoint", trained, "--prompt", "The ", "--max-new-tokens", "20", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == one["text"] + "\n"
    progress = [line for line in proc.stderr.splitlines() if line.startswith("generate: ")]
    assert [p.split(" tokens")[0] for p in progress] == ["generate: 16/20", "generate: 20/20"], proc.stderr
    # a damaged shard is named in one line, before a token is generated
    import shutil

    bad = trained.parent / "damaged"
    shutil.copytree(trained / (trained / "latest").read_text().strip(), bad)
    shard = sorted((bad / "state").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["generate", "--checkpoint", str(bad), "--prompt", "The "]) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err == f"tessera generate: error: corrupt checkpoint file {shard}: sha256 differs from the manifest\n"
    )

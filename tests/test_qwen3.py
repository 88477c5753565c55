"""The Qwen3 family on one process: tessera's Qwen3 gives transformers' Qwen3ForCausalLM logits and first loss
with the same weights (head_dim != dim / heads, tied and untied head), through tessera's HF writer into
transformers and through a transformers-saved directory into tessera; config.json is read by model_type and
what the file cannot represent is refused by field name; init depends only on the seed and the name."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from helpers import NEEDS_TRANSFORMERS

pytestmark = NEEDS_TRANSFORMERS

from tessera.models import get_preset, get_spec  # noqa: E402
from tessera.models.hf import (  # noqa: E402
    check_hf_weights,
    config_from_manifest,
    hf_to_tessera_name,
    load_hf_weights,
    read_hf_config,
    save_hf,
    tessera_to_hf_name,
    weight_files,
)
from tessera.models.qwen3 import QWEN3, Qwen3Config  # noqa: E402

VOCAB = 96
TOKENS = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
# 4 heads x head_dim 16 = 64 != dim 48; 2 kv heads (GQA)
TINY = dict(
    dim=48,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    ffn_dim=96,
    max_seq_len=256,
    rope_theta=1e6,
    norm_eps=1e-6,
)


def _close(got, want, tol=1e-5):
    err = (got - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), err


def _hf_model(path, tied):
    """A transformers Qwen3 with random weights (the norms too: ones would hide QK-norm), saved to `path`."""
    from transformers import Qwen3Config as HFQwen3Config
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = HFQwen3Config(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=tied,
    )
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _tessera_loss(model, tokens):
    """The mean next-token loss through tessera's fused head (model(inputs, targets=...))."""
    from tessera.parallel.loss import apply_loss_head

    model = apply_loss_head(copy.deepcopy(model), head=QWEN3.head)
    total, count = model(tokens[:, :-1], targets=tokens[:, 1:])
    return total / count


@pytest.mark.parametrize("tied", [False, True])
def test_tesseras_export_loads_into_transformers_with_tesseras_logits_and_loss(tmp_path, tied):
    from transformers import Qwen3ForCausalLM

    cfg = Qwen3Config(**TINY, tie_word_embeddings=tied)
    ours = QWEN3.build_model(cfg, seed=7)
    with torch.no_grad():  # norms other than ones, as a trained model has
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tied
    save_hf(ours.state_dict(), cfg, tmp_path)
    names = set(weight_files(tmp_path))
    assert ("lm_head.weight" in names) != tied  # a tied checkpoint has no lm_head.weight, as transformers writes it
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] == tied
    theirs = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert (theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()) == tied
    with torch.no_grad():
        want = theirs(TOKENS).logits
        _close(ours(TOKENS), want)
        assert not torch.allclose(want, torch.zeros_like(want))
        their_loss = theirs(TOKENS, labels=TOKENS).loss  # transformers shifts the labels itself
        _close(_tessera_loss(ours, TOKENS), their_loss)
        _close(F.cross_entropy(ours(TOKENS[:, :-1]).flatten(0, 1), TOKENS[:, 1:].flatten()), their_loss)


@pytest.mark.parametrize("tied", [False, True])
def test_a_transformers_qwen3_loads_into_tessera_with_its_logits_and_loss(tmp_path, tied):
    theirs = _hf_model(tmp_path, tied)
    cfg = read_hf_config(tmp_path)
    assert cfg == Qwen3Config(**TINY, tie_word_embeddings=tied)
    check_hf_weights(tmp_path, cfg)
    ours = QWEN3.build_model(cfg, seed=None)
    with torch.no_grad():
        for p in ours.parameters():
            p.fill_(float("nan"))  # every parameter must come from the files
    load_hf_weights(ours, tmp_path)
    assert all(torch.isfinite(p).all() for p in ours.parameters())
    with torch.no_grad():
        _close(ours(TOKENS), theirs(TOKENS).logits)
        _close(_tessera_loss(ours, TOKENS), theirs(TOKENS, labels=TOKENS).loss)


def test_the_qk_norm_comes_before_rope_and_matters(tmp_path):
    """Scaling q_norm changes the logits (it is applied), and the model is not invariant to it."""
    cfg = Qwen3Config(**TINY, tie_word_embeddings=True)
    model = QWEN3.build_model(cfg, seed=1)
    with torch.no_grad():
        before = model(TOKENS)
        model.layers["0"].self_attn.q_norm.weight.mul_(3.0)
        assert not torch.allclose(before, model(TOKENS))


def test_hf_names_are_huggingfaces_own_and_round_trip():
    from transformers import Qwen3Config as HFQwen3Config
    from transformers import Qwen3ForCausalLM

    for tied in (False, True):
        cfg = Qwen3Config(**TINY, tie_word_embeddings=tied)
        ours = QWEN3.build_model(cfg, device="meta")
        names = [n for n, _ in ours.named_parameters()]
        assert ("lm_head.weight" in names) != tied  # a tied head is named once, by its owner
        for n in names:
            assert hf_to_tessera_name(tessera_to_hf_name(n, cfg), cfg) == n
        hf = HFQwen3Config(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=tied,
        )
        with torch.device("meta"):
            theirs = Qwen3ForCausalLM(hf)
        assert {tessera_to_hf_name(n, cfg) for n in names} == {n for n, _ in theirs.named_parameters()}
    assert hf_to_tessera_name("model.rotary_emb.inv_freq", cfg) is None
    with pytest.raises(ValueError, match="not a Qwen3 weight"):
        hf_to_tessera_name("model.layers.0.self_attn.q_proj.bias", cfg)


def test_hf_dir_config_json_gives_a_qwen3_config(tmp_path):
    from tessera.config import Config, flag_names
    from tessera.topology.errors import with_flags

    _hf_model(tmp_path, tied=True)
    cfg = Config.create(model=f"hf:{tmp_path}").model_config
    assert isinstance(cfg, Qwen3Config) and cfg.head_dim == 16 and cfg.tie_word_embeddings
    assert Config.create(init_from_hf=str(tmp_path)).model_config == cfg
    assert Config.create(model="qwen3-debug").model_config == get_preset("qwen3-debug")
    # a preset that disagrees names the differing field, and the CLI says it as --model
    with pytest.raises(
        ValueError, match=r"preset=qwen3-debug does not match the Hugging Face config.json \(dim 48 vs 64"
    ) as caught:
        _ = Config.create(init_from_hf=str(tmp_path), model="qwen3-debug").model_config
    said = with_flags(str(caught.value), flag_names())
    assert said.startswith("--model qwen3-debug does not match") and "drop --model:" in said, said
    # the export side finds the family from a manifest's preset, an hf: path, or the fields alone
    saved = cfg.as_dict()
    assert config_from_manifest({"preset": f"hf:{tmp_path}", "config": saved}) == cfg
    assert config_from_manifest({"preset": "hf:/gone", "config": saved}) == cfg
    assert config_from_manifest(
        {"preset": "qwen3-debug", "config": get_preset("qwen3-debug", n_layers=1).as_dict()}
    ) == get_preset("qwen3-debug", n_layers=1)
    assert (
        type(config_from_manifest({"preset": "debug", "config": get_preset("debug").as_dict()})).__name__
        == "LlamaConfig"
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("attention_bias", True, "biases in attention"),
        ("use_sliding_window", True, "sliding-window attention"),
        ("layer_types", ["full_attention", "sliding_attention"], "layer types"),
        ("hidden_act", "gelu", "activation 'gelu'"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "rope type 'yarn'"),
        ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope type 'linear'"),
        ("architectures", ["Qwen3ForSequenceClassification"], None),
    ],
)
def test_what_qwen3_cannot_represent_is_refused_by_field_name(tmp_path, field, value, message):
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "layer_types": ["full_attention"] * 2,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_hf_config(tmp_path) == Qwen3Config(**{**TINY, "max_seq_len": 32768})
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    pattern = (
        r"architecture 'Qwen3ForSequenceClassification' \(model_type 'qwen3'\) is not supported"
        if message is None
        else f"config.json: {field}: {message}.* is not supported"
    )
    with pytest.raises(ValueError, match=pattern):
        read_hf_config(tmp_path)


def test_an_unknown_model_type_names_the_families_tessera_reads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(
        ValueError,
        match=r"architecture 'Qwen2ForCausalLM' \(model_type 'qwen2'\) is not supported; "
        r"tessera loads .*Qwen3ForCausalLM \(model_type 'qwen3'\)",
    ):
        read_hf_config(tmp_path)


def test_a_tied_checkpoint_with_only_the_heads_name_still_loads(tmp_path):
    """Some tied checkpoints store the shared matrix as lm_head.weight only: it fills the embedding."""
    from tessera.checkpointing.safe_io import write_safetensors

    cfg = Qwen3Config(**TINY, tie_word_embeddings=True)
    src = QWEN3.build_model(cfg, seed=2)
    save_hf(src.state_dict(), cfg, tmp_path)
    from tessera.checkpointing.safe_io import read_safetensors_slice

    tensors = {
        n: read_safetensors_slice(tmp_path / "model.safetensors", n, (slice(None),)) for n in weight_files(tmp_path)
    }
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    write_safetensors(tensors, tmp_path / "model.safetensors", {"format": "pt"})
    check_hf_weights(tmp_path, cfg)
    dst = QWEN3.build_model(cfg, seed=5)
    load_hf_weights(dst, tmp_path)
    assert (
        torch.equal(dst.embed_tokens.weight, src.embed_tokens.weight) and dst.lm_head.weight is dst.embed_tokens.weight
    )
    # a state dict whose two names of the tied matrix disagree (a tie broken in training) is not exported
    state = {**src.state_dict(), "lm_head.weight": src.embed_tokens.weight.detach() + 1}
    with pytest.raises(ValueError, match="lm_head.weight and embed_tokens.weight are one tied parameter"):
        save_hf(state, cfg, tmp_path / "broken")


def test_convert_writes_tesseras_names_once_for_a_tied_head(tmp_path):
    from tessera.cli import main
    from tessera.checkpointing.checkpoint import read_safetensors

    _hf_model(tmp_path / "hf", tied=True)
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "t.safetensors")]) == 0
    tensors = read_safetensors(tmp_path / "t.safetensors")
    assert "embed_tokens.weight" in tensors and "lm_head.weight" not in tensors
    assert tensors["layers.1.self_attn.k_norm.weight"].shape == (16,)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (64, 48)


def test_init_depends_only_on_seed_and_name():
    a, b = QWEN3.build_model(get_preset("qwen3-debug"), seed=3), QWEN3.build_model(get_preset("qwen3-debug"), seed=3)
    c = QWEN3.build_model(get_preset("qwen3-debug"), seed=4)
    assert a.lm_head.weight is a.embed_tokens.weight  # qwen3-debug ties
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if n.endswith("norm.weight"):  # q_norm and k_norm too
            assert torch.equal(p, torch.ones_like(p)), n
        else:
            assert not torch.equal(p, r), n
    # a tensor's values do not depend on what else the model holds
    deeper = QWEN3.build_model(get_preset("qwen3-debug", n_layers=3, tie_word_embeddings=False), seed=3)
    assert torch.equal(deeper.embed_tokens.weight, a.embed_tokens.weight)
    assert torch.equal(deeper.layers["1"].self_attn.k_proj.weight, a.layers["1"].self_attn.k_proj.weight)
    std = lambda n: QWEN3.init_std(n, get_preset("qwen3-debug"))  # noqa: E731
    assert std("layers.0.self_attn.q_norm.weight") == "ones" and std("norm.weight") == "ones"
    assert std("layers.1.mlp.down_proj.weight") == pytest.approx(0.02 / 2) == std("layers.0.self_attn.o_proj.weight")


def test_presets_have_the_published_sizes_and_build_on_meta():
    published = {"qwen3-0.6b": 0.596e9, "qwen3-1.7b": 1.721e9, "qwen3-8b": 8.191e9}
    for name, count in published.items():
        cfg = get_preset(name)
        assert abs(cfg.num_params() - count) / count < 0.002, name
        model = QWEN3.build_model(cfg, device="meta")
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert get_preset("qwen3-0.6b").tie_word_embeddings and not get_preset("qwen3-8b").tie_word_embeddings
    debug = get_preset("qwen3-debug")
    assert debug.n_heads * debug.head_dim != debug.dim and get_spec("qwen3") is QWEN3
    assert QWEN3.shape(debug).qk_norm and QWEN3.shape(debug).tied_embeddings


def test_a_pipeline_split_runs_like_the_whole_model():
    """Stages keep the one-process names; the tied last stage keeps embed_tokens and does not embed hidden states."""
    model = QWEN3.build_model(get_preset("qwen3-debug"), seed=0)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["1"]
    first.norm = first.lm_head = None
    del last.layers["0"]
    with torch.no_grad():
        hidden = first(TOKENS)
        assert hidden.shape == (*TOKENS.shape, 64)
        _close(last(hidden), model(TOKENS), 1e-6)
    untied_second = copy.deepcopy(last)
    untied_second.embed_tokens = None
    with pytest.raises(ValueError, match="without embed_tokens"):
        untied_second(TOKENS)
    with pytest.raises(ValueError, match="before the last"):
        first(TOKENS, targets=TOKENS)
    with pytest.raises(TypeError, match="needs the fused loss head"):
        model(TOKENS, targets=TOKENS)

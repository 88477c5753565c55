"""The DeepSeek-V3 family on one process: YaRN RoPE (models/layers.py's ROPE_SCALINGS entry, which gpt-oss shares)
against transformers' `_compute_yarn_parameters`, multi-head latent attention, group-limited sigmoid routing,
and tessera's DeepseekV3 against transformers' DeepseekV3ForCausalLM with the same weights, through tessera's
Hugging Face writer and reader; what the family cannot represent is refused by name."""

import pytest
import torch

from helpers import NEEDS_TRANSFORMERS

pytestmark = NEEDS_TRANSFORMERS

from tessera.models.layers import ROPE_SCALINGS, Rotary, yarn_scaled  # noqa: E402

# (rope_parameters, theta): DeepSeek-V3's published YaRN (mscale = mscale_all_dim: attention factor 1), gpt-oss's
# (truncate False, attention factor 0.1 ln 32 + 1), and mscale != mscale_all_dim
YARNS = [
    (
        dict(
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        10000.0,
    ),
    (dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False), 150000.0),
    (dict(factor=4.0, original_max_position_embeddings=256, mscale=0.707, mscale_all_dim=1.0), 10000.0),
]


def _their_yarn(params, theta, head_dim=64):
    from transformers import DeepseekV3Config as HFConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    rope = {"rope_type": "yarn", "rope_theta": theta, **params}
    max_pos = int(params["factor"] * params["original_max_position_embeddings"])
    return _compute_yarn_parameters(
        HFConfig(qk_rope_head_dim=head_dim, max_position_embeddings=max_pos, rope_parameters=rope)
    )


@pytest.mark.parametrize("params, theta", YARNS)
def test_yarn_is_transformers_yarn(params, theta):
    """tessera's float64 frequencies equal transformers' (float32) to its rounding; the attention factor exactly."""
    want, want_factor = _their_yarn(params, theta)
    plain = 1.0 / theta ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    got, factor = ROPE_SCALINGS["yarn"](plain, theta, **params)
    assert got.dtype == torch.float64 and factor == want_factor
    assert ((got - want.double()).abs() / want.double()).max().item() < 1e-6
    # the fastest frequencies kept, the slowest divided by the factor
    assert got[0] == plain[0] and torch.allclose(got[-1], plain[-1] / params["factor"], rtol=1e-12, atol=0)


def test_truncate_rounds_the_ramp_outward():
    plain = 1.0 / 150000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    params = dict(factor=32.0, original_max_position_embeddings=4096)
    truncated, _ = yarn_scaled(plain, 150000.0, **params)
    exact, _ = yarn_scaled(plain, 150000.0, **params, truncate=False)
    assert not torch.equal(truncated, exact)


@pytest.mark.parametrize("params, theta", YARNS)
def test_rotary_tables_are_transformers_cos_and_sin_with_the_attention_factor(params, theta):
    from transformers import DeepseekV3Config as HFConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    max_pos = int(params["factor"] * params["original_max_position_embeddings"])
    rope = {"rope_type": "yarn", "rope_theta": theta, **params}
    theirs = DeepseekV3RotaryEmbedding(
        HFConfig(qk_rope_head_dim=64, max_position_embeddings=max_pos, rope_parameters=rope)
    )
    positions = torch.tensor([0, 1, 7, 100, 4095, 5000])
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = Rotary(64, 5001, theta, tuple(params.items()), rope_type="yarn")
    # transformers' angles are fp32 products position x inv_freq: two fp32 roundings of an angle up to the position
    bound = 2.4e-7 * (positions[:, None] + 1.0)
    assert ((ours.cos[positions] - cos[0, :, :32]).abs() <= bound).all()
    assert ((ours.sin[positions] - sin[0, :, :32]).abs() <= bound).all()
    assert ours.cos[0, 0].item() == pytest.approx(_their_yarn(params, theta)[1], abs=1e-7)  # cos 0 = the factor


# ----------------------------------------------------------------------------- the model against transformers
from tessera.models.deepseek_v3 import DEEPSEEK_V3, DeepseekV3Config  # noqa: E402
from tessera.models.hf import check_hf_weights, load_hf_weights, read_hf_config, save_hf, weight_files  # noqa: E402

VOCAB = 128
TOKENS = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
SMALL_YARN = dict(
    factor=4.0, original_max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
)
# one dense layer, then two MoE layers of 8 experts in 2 groups (1 eligible), top 2, one shared expert
TINY = dict(
    dim=64,
    n_layers=3,
    n_heads=4,
    vocab_size=VOCAB,
    dense_ffn_dim=128,
    moe_ffn_dim=32,
    n_experts=8,
    top_k=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_seq_len=2048,
)
# (tessera's fields beyond TINY): query latent, YaRN and interleaved RoPE; no query latent, plain RoPE
VARIANTS = {
    "latent-q-yarn": dict(q_lora_rank=32, rope_scaling=tuple(sorted(SMALL_YARN.items()))),
    "plain-q": dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False, n_shared_experts=2, n_group=1),
}


def _close(got, want, tol=1e-5):
    err = (got - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), err


def _hf_config(cfg: DeepseekV3Config):
    from transformers import DeepseekV3Config as HFConfig

    yarn = dict(cfg.rope_scaling or ())
    rope = {"rope_type": "yarn" if yarn else "default", "rope_theta": cfg.rope_theta, **yarn}
    return HFConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.dense_ffn_dim,
        moe_intermediate_size=cfg.moe_ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        n_shared_experts=cfg.n_shared_experts,
        n_routed_experts=cfg.n_experts,
        routed_scaling_factor=cfg.routed_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        num_experts_per_tok=cfg.top_k,
        first_k_dense_replace=cfg.first_k_dense_replace,
        norm_topk_prob=cfg.norm_topk_prob,
        max_position_embeddings=cfg.max_seq_len,
        rope_parameters=rope,
        rope_interleave=cfg.rope_interleave,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def _decisive(name, p, g):
    """Norms other than ones, a router and routing bias that route decisively (transformers starts both at 0)."""
    if name.endswith("norm.weight"):
        p.uniform_(0.5, 1.5, generator=g)
    elif name.endswith(("mlp.gate.weight",)):
        p.normal_(0.0, 0.3, generator=g)
    elif name.endswith(("e_score_correction_bias", "expert_bias")):
        p.normal_(0.0, 0.1, generator=g)
    elif ".experts." in name or "experts.gate_proj" in name:
        p.normal_(0.0, 0.1, generator=g)


def _hf_model(path, cfg):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(_hf_config(cfg)).float().eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            _decisive(name, t, g)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _ours(cfg, seed):
    model = DEEPSEEK_V3.build_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            _decisive(name, t, g)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_transformers_deepseek_v3_loads_into_tessera_with_its_logits(tmp_path, variant):
    want_cfg = DeepseekV3Config(**{**TINY, **VARIANTS[variant]})
    theirs = _hf_model(tmp_path, want_cfg)
    cfg = read_hf_config(tmp_path)
    assert cfg == want_cfg
    check_hf_weights(tmp_path, cfg)
    ours = DEEPSEEK_V3.build_model(cfg, seed=None)
    with torch.no_grad():
        for t in [*ours.parameters(), ours.layers["1"].mlp.expert_bias]:
            t.fill_(float("nan"))  # every parameter, and the routing bias, must come from the files
    load_hf_weights(ours, tmp_path)
    assert all(torch.isfinite(p).all() for p in ours.parameters())
    assert torch.equal(ours.layers["2"].mlp.expert_bias, theirs.model.layers[2].mlp.gate.e_score_correction_bias)
    with torch.no_grad():
        want = theirs(TOKENS).logits
        _close(ours.eval()(TOKENS), want)
        # the routing bias matters: without it other experts are chosen
        ours.layers["1"].mlp.expert_bias.zero_()
        assert (ours(TOKENS) - want).abs().max().item() > 1e-4
    save_hf(ours.state_dict(), cfg, tmp_path / "again")  # tessera's export: transformers' own names
    assert set(weight_files(tmp_path / "again")) == set(weight_files(tmp_path))
    assert read_hf_config(tmp_path / "again") == cfg  # and the config it writes reads back as it was


@pytest.mark.parametrize("variant", VARIANTS)
def test_tesseras_export_loads_into_transformers_with_tesseras_logits(tmp_path, variant):
    from transformers import DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**{**TINY, **VARIANTS[variant]})
    ours = _ours(cfg, seed=7).eval()
    save_hf(ours.state_dict(), cfg, tmp_path)
    theirs = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert torch.equal(theirs.model.layers[1].mlp.gate.e_score_correction_bias, ours.layers["1"].mlp.expert_bias)
    assert torch.equal(theirs.model.layers[0].mlp.down_proj.weight, ours.layers["0"].dense_mlp.down_proj.weight)
    with torch.no_grad():
        want = theirs(TOKENS).logits
        _close(ours(TOKENS), want)
        assert not torch.allclose(want, torch.zeros_like(want))


def test_generating_with_the_kv_cache_equals_recomputing_the_prefix():
    """The kv_cache slot holds latent attention's expanded keys and values (v narrower than k)."""
    from tessera.models.generation import generate

    model = _ours(DeepseekV3Config(**{**TINY, **VARIANTS["latent-q-yarn"]}), seed=4).eval()
    with torch.no_grad():
        cached = generate(model, TOKENS[:, :5], 6, use_cache=True, keep_logits=True)
        fresh = generate(model, TOKENS[:, :5], 6, use_cache=False, keep_logits=True)
    assert cached.tokens == fresh.tokens
    for a, b in zip(cached.logits, fresh.logits):
        _close(a, b)


def test_greedy_decoding_equals_transformers_generate(tmp_path):
    """tessera's cache of expanded keys and values against transformers' cache of the compressed latents."""
    from transformers import DeepseekV3ForCausalLM

    from tessera.models.generation import generate

    cfg = DeepseekV3Config(**{**TINY, **VARIANTS["latent-q-yarn"]})
    ours = _ours(cfg, seed=5).eval()
    save_hf(ours.state_dict(), cfg, tmp_path)
    theirs = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    prompt = TOKENS[:1, :6]
    with torch.no_grad():
        want = theirs.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        got = generate(ours, prompt, 10, use_cache=True)
    assert got.tokens[0] == want[0, 6:].tolist()


# ----------------------------------------------------------------------------- group-limited routing
def _naive_route(scores, bias, top_k, n_group, topk_group, norm, scale):
    """transformers' DeepseekV3TopkRouter token by token in float64, from the sigmoid scores."""
    per = scores.shape[-1] // n_group
    ids, weights = [], []
    for s in scores:
        biased = s + bias
        group_score = [sorted(biased[g * per : (g + 1) * per].tolist())[-2:] for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -sum(group_score[g]))[:topk_group]
        eligible = [e for e in range(len(s)) if e // per in groups]
        chosen = sorted(eligible, key=lambda e: -biased[e].item())[:top_k]
        w = s[chosen]
        w = w / (w.sum() + 1e-20) if norm else w
        ids.append(sorted(chosen))
        weights.append(dict(zip(chosen, (w * scale).tolist())))
    return ids, weights


@pytest.mark.parametrize("n_group, topk_group, top_k, norm", [(4, 2, 3, True), (2, 1, 2, False), (8, 3, 4, True)])
def test_group_limited_routing_is_transformers_router(n_group, topk_group, top_k, norm):
    from tessera.models.moe import route

    g = torch.Generator().manual_seed(n_group * 10 + top_k)
    logits = torch.randn(50, 16, dtype=torch.float64, generator=g)
    bias = torch.randn(16, dtype=torch.float64, generator=g) * 0.3
    scores, ids, weights = route(logits, top_k, "sigmoid", norm, bias, n_group, topk_group, scale=2.5)
    want_ids, want_weights = _naive_route(torch.sigmoid(logits), bias, top_k, n_group, topk_group, norm, 2.5)
    for t in range(50):
        assert sorted(ids[t].tolist()) == want_ids[t]
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            assert w == pytest.approx(want_weights[t][e], rel=1e-12)
    # the groups matter: with every group eligible another expert wins somewhere
    assert not torch.equal(route(logits, top_k, "sigmoid", norm, bias)[1].sort(-1).values, ids.sort(-1).values)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(n_group=3), r"n_group=3 must divide n_experts=8; use a divisor of 8"),
        (dict(n_group=2, topk_group=3), r"topk_group=3 must be between 1 and n_group=2"),
        (dict(n_group=4, topk_group=1, top_k=3), r"top_k=3 is more than the topk_group=1 groups of 2 experts hold"),
        (dict(n_group=8), r"n_group=8 leaves 1 expert per group; groups need 2 or more"),
        (dict(first_k_dense_replace=4), r"first_k_dense_replace=4 must be between 0 and n_layers=3"),
        (dict(rope_scaling={"factor": 4.0, "low_freq_factor": 1.0}), r"'low_freq_factor' is not a YaRN parameter"),
    ],
)
def test_a_config_that_cannot_route_or_rotate_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        DeepseekV3Config(**{**TINY, **fields})


def test_an_ep_degree_the_experts_do_not_divide_is_refused():
    from tessera.topology.errors import ConfigError
    from tessera.topology.shapes import check_expert_parallel

    with pytest.raises(ConfigError, match=r"ep=3 does not divide the 256 experts; use a divisor of 256"):
        check_expert_parallel(DEEPSEEK_V3.shape(DEEPSEEK_V3.config("deepseek-v3-671b")).n_experts, 3, 3)


def test_a_tp_degree_the_dense_layers_width_does_not_take_is_refused():
    from tessera.topology.errors import ConfigError
    from tessera.topology.shapes import check_tensor_parallel

    check_tensor_parallel(DEEPSEEK_V3.shape(DEEPSEEK_V3.config("deepseek-v3-debug")), 4)
    with pytest.raises(ConfigError, match=r"tp=4 does not divide the dense layers' MLP width dense_ffn_dim=130"):
        check_tensor_parallel(DEEPSEEK_V3.shape(DEEPSEEK_V3.config("deepseek-v3-debug", dense_ffn_dim=130)), 4)


# ----------------------------------------------------------------------------- config.json
def test_another_familys_checkpoint_is_refused_in_one_line(tmp_path):
    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64}
    with pytest.raises(
        ValueError,
        match=r"^config.json: architecture 'Qwen3ForCausalLM' \(model_type 'qwen3'\) is not supported; tessera's "
        r"deepseek_v3 family loads DeepseekV3ForCausalLM checkpoints$",
    ):
        DEEPSEEK_V3.hf.read_config(qwen3, "config.json")
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    with pytest.raises(ValueError, match=r"architecture 'LlamaForCausalLM' \(model_type 'llama'\) is not supported"):
        DEEPSEEK_V3.hf.read_config(llama, "config.json")
    with pytest.raises(ValueError, match=r"unexpected parameter 'model.layers.0.self_attn.k_proj.weight'"):
        DEEPSEEK_V3.hf.from_hf("model.layers.0.self_attn.k_proj.weight")
    # a Qwen3 directory given with a DeepSeek-V3 preset: one line naming the sizes that differ
    from tessera.models.hf import compare_with_preset
    from tessera.models.qwen3 import QWEN3

    qwen = QWEN3.build_model(QWEN3.config("qwen3-debug"), seed=0)
    save_hf(qwen.state_dict(), qwen.config, tmp_path / "qwen3")
    with pytest.raises(ValueError, match=r"^preset=deepseek-v3-debug does not match .*family qwen3 vs deepseek_v3"):
        compare_with_preset(
            read_hf_config(tmp_path / "qwen3"), DEEPSEEK_V3.config("deepseek-v3-debug"), "deepseek-v3-debug"
        )


def _published(**overrides):
    """deepseek-ai/DeepSeek-V3's config.json (its fields tessera reads), as transformers 4.x wrote it."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "vocab_size": 129280,
        "attention_bias": False,
        **overrides,
    }


def test_the_published_config_is_the_671b_preset():
    got = DEEPSEEK_V3.hf.read_config(_published(), "config.json")
    assert got == DEEPSEEK_V3.config("deepseek-v3-671b", aux_loss_coef=got.aux_loss_coef, bias_rate=got.bias_rate)
    # the multi-token-prediction layer's own tensors are not the model's
    assert DEEPSEEK_V3.hf.from_hf("model.layers.61.eh_proj.weight") is None


def test_fields_config_json_leaves_out_take_transformers_defaults():
    from transformers import DeepseekV3Config as HFConfig

    c = {k: _published()[k] for k in ("architectures", "model_type", "vocab_size", "num_hidden_layers")}
    c |= dict(
        hidden_size=64, num_attention_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=32
    )
    ours, theirs = DEEPSEEK_V3.hf.read_config(c, "config.json"), HFConfig(**c)
    for field, hf in [
        ("n_group", "n_group"),
        ("topk_group", "topk_group"),
        ("top_k", "num_experts_per_tok"),
        ("q_lora_rank", "q_lora_rank"),
        ("kv_lora_rank", "kv_lora_rank"),
        ("first_k_dense_replace", "first_k_dense_replace"),
        ("n_shared_experts", "n_shared_experts"),
        ("routed_scaling_factor", "routed_scaling_factor"),
        ("norm_topk_prob", "norm_topk_prob"),
        ("qk_nope_head_dim", "qk_nope_head_dim"),
        ("qk_rope_head_dim", "qk_rope_head_dim"),
        ("v_head_dim", "v_head_dim"),
        ("rope_interleave", "rope_interleave"),
        ("norm_eps", "rms_norm_eps"),
        ("max_seq_len", "max_position_embeddings"),
        ("rope_theta", "rope_theta"),
    ]:
        want = theirs.rope_parameters["rope_theta"] if hf == "rope_theta" else getattr(theirs, hf)
        assert getattr(ours, field) == want, field


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("scoring_func", "softmax", "scores other than sigmoid"),
        ("topk_method", "greedy", "routing 'greedy'"),
        ("attention_bias", True, "biases in attention"),
        ("hidden_act", "gelu", "activation 'gelu'"),
        ("num_key_value_heads", 8, "8 key/value heads for 128 query heads"),
        ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope type 'linear'"),
    ],
)
def test_what_deepseek_v3_cannot_represent_is_refused_by_field_name(field, value, message):
    with pytest.raises(ValueError, match=f"config.json: {field}: {message}.* is not supported"):
        DEEPSEEK_V3.hf.read_config(_published(**{field: value}), "config.json")


# ----------------------------------------------------------------------------- sizes for the planner
@pytest.mark.parametrize("preset", ["deepseek-v3-debug", "deepseek-v3-lite", "deepseek-v3-671b"])
def test_the_planners_sizes_are_the_models(preset):
    """ModelShape's latent attention and dense first layers: the parameter count is the built model's, and one
    MoE block's tp-rank shapes are its modules' (the routed experts apart)."""
    from tessera.topology.shapes import layer_param_shapes

    cfg = DEEPSEEK_V3.config(preset)
    shape = DEEPSEEK_V3.shape(cfg)
    model = DEEPSEEK_V3.build_model(cfg, device="meta")
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    block = model.layers[str(cfg.first_k_dense_replace)]
    got = [tuple(p.shape) if p.dim() == 2 else (p.shape[0], 1) for p in block.parameters() if p.dim() < 3]
    assert sorted(got) == sorted(layer_param_shapes(shape, 1, 1, experts=False))


def test_671b_counts_the_published_671b_total_and_37b_active():
    """DeepSeek-V3's published 671 B parameters (the main model, without its 14 B multi-token-prediction module)
    within 1%, and 37 B activated per token to the figure's own precision (blocks with 8 + 1 experts and the
    head: 36.6 B; the embedding's lookup is not a matmul)."""
    shape = DEEPSEEK_V3.shape(DEEPSEEK_V3.config("deepseek-v3-671b"))
    assert abs(shape.num_params() - 671e9) <= 0.01 * 671e9
    assert round(shape.matmul_params() / 1e9) == 37
    lite = DEEPSEEK_V3.shape(DEEPSEEK_V3.config("deepseek-v3-lite"))  # Moonlight-16B-A3B: 16 B total
    assert round(lite.num_params() / 1e9) == 16


# ----------------------------------------------------------------------------- parallel
def build_latent_q():
    """The tiny configs' models (the runner seeds them): module-level, so the ranks unpickle them."""
    return DEEPSEEK_V3.build_model(DeepseekV3Config(**{**TINY, **VARIANTS["latent-q-yarn"]}), device="meta")


def build_plain_q():
    return DEEPSEEK_V3.build_model(DeepseekV3Config(**{**TINY, **VARIANTS["plain-q"]}), device="meta")


@pytest.mark.parametrize(
    "build, layout",
    [(build_latent_q, dict(tp=2)), (build_plain_q, dict(tp=2)), (build_latent_q, dict(dp_shard=2, ep=2))],
    ids=["tp2-latent-q", "tp2-plain-q", "dp2xep2"],
)
def test_tp2_and_ep2_train_like_one_process(build, layout):
    """Latent attention's heads over tp (q_b_proj or q_proj and kv_b_proj split, o_proj reduced; the down
    projections and latent norms replicated, their gradients whole on each rank), the dense layer's MLP and the
    MoE blocks' experts over tp, the group-limited routing over ep: two SGD steps' losses and every gradient by
    name equal one process's."""
    from tessera.testing import assert_layouts_equivalent
    from tessera.topology.layout import Layout

    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(7))
    assert_layouts_equivalent(build, [Layout(**layout)], batch=(tokens[:, :-1], tokens[:, 1:]), spec=DEEPSEEK_V3)


def test_a_pipeline_stage_of_dense_layers_alone_trains(tmp_path):
    """pp3 puts the dense first layer alone on stage 0: that stage has no MoE block but still joins the step's
    expert-load all-reduce (zeros for its layer), and the biases of the MoE layers on the other stages move."""
    import json

    from helpers import cli_here

    metrics = tmp_path / "m.jsonl"
    args = ("train", "--model", "deepseek-v3-debug", "--pp", "3", "--microbatches", "4", "--steps", "2")
    out = cli_here(*args, "--metrics", str(metrics), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("type") != "header"]
    assert len(records) == 2
    tokens = records[0]["moe"]["tokens_per_expert"]
    assert tokens[0] == [0] * 8 and all(sum(row) == 8 * 64 * 2 for row in tokens[1:])  # 512 tokens, top 2

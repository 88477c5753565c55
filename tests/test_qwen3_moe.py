"""The Qwen3-MoE family on one process: tessera's Qwen3Moe gives transformers' Qwen3MoeForCausalLM logits with
the same weights (norm_topk_prob on and off), through tessera's HF writer into transformers and through a
transformers-saved directory into tessera; the stacked experts are one HF tensor per expert, a missing or
misshapen expert is named, and a rank reads only its experts; config.json fields the family cannot
represent are refused by name; the router and the experts match a naive float64 definition, and
grouped_mm's per-expert loop a naive product."""

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F

from helpers import NEEDS_TRANSFORMERS

pytestmark = NEEDS_TRANSFORMERS

from tessera.models.hf import (  # noqa: E402
    check_hf_weights,
    hf_config_dict,
    hf_to_tessera_name,
    hf_weight_map,
    load_hf_weights,
    read_hf_config,
    read_hf_parameter,
    save_hf,
    tessera_to_hf_name,
    weight_files,
)
from tessera.models.moe import grouped_mm  # noqa: E402
from tessera.models.qwen3_moe import QWEN3_MOE, Qwen3MoeConfig  # noqa: E402

VOCAB = 128
TOKENS = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
# 4 heads x head_dim 16 = 64 = dim; 2 kv heads (GQA); 8 experts, top 2
TINY = dict(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    moe_ffn_dim=32,
    n_experts=8,
    top_k=2,
    max_seq_len=256,
    rope_theta=1e6,
    norm_eps=1e-6,
)
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def _close(got, want, tol=1e-5):
    err = (got - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), err


def _hf_config(norm_topk, **overrides):
    from transformers import Qwen3MoeConfig as HFQwen3MoeConfig

    return HFQwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
        attn_implementation="eager",
        **overrides,
    )


def _hf_model(path, norm_topk):
    """A transformers Qwen3-MoE with random weights, saved to `path`: the norms other than ones and the router
    (which transformers may start at zeros) large enough that the routing is decisive and matters."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_hf_config(norm_topk)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            elif ".experts." in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _ours(cfg, seed):
    """tessera's model with norms other than ones and a router that routes decisively."""
    model = QWEN3_MOE.build_model(cfg, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(len(name) + seed)
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=g)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3, generator=g)
    return model


@pytest.mark.parametrize("norm_topk", [True, False])
def test_tesseras_export_loads_into_transformers_with_tesseras_logits(tmp_path, norm_topk):
    from transformers import Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**TINY, norm_topk_prob=norm_topk)
    ours = _ours(cfg, seed=7).eval()
    save_hf(ours.state_dict(), cfg, tmp_path)
    names = set(weight_files(tmp_path))
    # one HF tensor per expert, no stacked name
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert not any(n.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")) for n in names)
    assert json.loads((tmp_path / "config.json").read_text())["norm_topk_prob"] == norm_topk
    theirs = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    experts = ours.layers["1"].mlp.experts
    their_experts = theirs.model.layers[1].mlp.experts
    assert torch.equal(their_experts.down_proj, experts.down_proj.detach())  # expert e's matrix went to expert e
    with torch.no_grad():
        want = theirs(TOKENS).logits
        _close(ours(TOKENS), want)
        assert not torch.allclose(want, torch.zeros_like(want))


@pytest.mark.parametrize("norm_topk", [True, False])
def test_a_transformers_qwen3_moe_loads_into_tessera_with_its_logits(tmp_path, norm_topk):
    theirs = _hf_model(tmp_path, norm_topk)
    cfg = read_hf_config(tmp_path)
    assert cfg == Qwen3MoeConfig(**TINY, norm_topk_prob=norm_topk)
    check_hf_weights(tmp_path, cfg)
    ours = QWEN3_MOE.build_model(cfg, seed=None)
    with torch.no_grad():
        for p in ours.parameters():
            p.fill_(float("nan"))  # every parameter must come from the files
    load_hf_weights(ours, tmp_path)
    assert all(torch.isfinite(p).all() for p in ours.parameters())
    with torch.no_grad():
        want = theirs(TOKENS).logits
        _close(ours.eval()(TOKENS), want)
        # the routing matters: another choice of experts gives other logits
        ours.layers["0"].mlp.gate.weight.mul_(-1.0)
        assert (ours(TOKENS) - want).abs().max().item() > 1e-3
    # tessera's export of what it loaded has transformers' own names, expert by expert
    save_hf(ours.state_dict(), cfg, tmp_path / "again")
    assert set(weight_files(tmp_path / "again")) == set(weight_files(tmp_path))


def test_hf_names_are_huggingfaces_own_and_round_trip(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**TINY)
    ours = QWEN3_MOE.build_model(cfg, device="meta")
    hf_names = set()
    for n, p in ours.named_parameters():
        hf = tessera_to_hf_name(n, cfg)
        if n.rpartition(".")[2] in EXPERT_NAMES:  # stacked: a template, the expert index where {} stands
            assert "{}" in hf and p.shape[0] == cfg.n_experts
            for e in range(cfg.n_experts):
                assert hf_to_tessera_name(hf.format(e), cfg) == (n, e)
                hf_names.add(hf.format(e))
        else:
            assert hf_to_tessera_name(hf, cfg) == n
            hf_names.add(hf)
    assert tessera_to_hf_name("layers.0.mlp.experts.up_proj", cfg) == "model.layers.0.mlp.experts.{}.up_proj.weight"
    # exactly the names transformers' save_pretrained writes
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(_hf_config(True)).save_pretrained(tmp_path, safe_serialization=True)
    assert set(weight_files(tmp_path)) == hf_names
    assert hf_to_tessera_name("model.rotary_emb.inv_freq", cfg) is None
    for bad in (
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.mlp.experts.gate_proj",
        "model.layers.0.mlp.experts.0.gate_up_proj",
        "model.layers.0.mlp.gate_proj.weight",
    ):
        with pytest.raises(ValueError, match="not a Qwen3-MoE weight"):
            hf_to_tessera_name(bad, cfg)


def _rewrite(src, dst, change):
    """A copy of the HF directory `src` at `dst` with its tensors dict passed through `change`."""
    from tessera.models.safetensors_io import read_safetensors, write_safetensors

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = read_safetensors(src / "model.safetensors")
    change(tensors)
    write_safetensors(tensors, dst / "model.safetensors", {"format": "pt"})


def test_a_missing_or_misshapen_expert_is_named_by_its_hf_name(tmp_path):
    cfg = Qwen3MoeConfig(**TINY)
    save_hf(QWEN3_MOE.build_model(cfg, seed=3).state_dict(), cfg, tmp_path / "ok")
    _rewrite(tmp_path / "ok", tmp_path / "gone", lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(
        ValueError,
        match=r"from_hf=.*gone: the checkpoint lacks model.layers.1.mlp.experts.5.up_proj.weight "
        r"\(and 0 more\)",
    ):
        check_hf_weights(tmp_path / "gone", cfg, flag="from_hf")
    with pytest.raises(ValueError, match=r"the checkpoint lacks model.layers.1.mlp.experts.5.up_proj.weight$"):
        load_hf_weights(QWEN3_MOE.build_model(cfg, seed=None), tmp_path / "gone")

    def shrink(t):
        t["model.layers.0.mlp.experts.2.down_proj.weight"] = t["model.layers.0.mlp.experts.2.down_proj.weight"][:, :16]

    _rewrite(tmp_path / "ok", tmp_path / "shape", shrink)
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: model.layers.0.mlp.experts.2.down_proj.weight has shape \[64, 16\], "
        r"config.json implies \[64, 32\]",
    ):
        check_hf_weights(tmp_path / "shape", cfg)
    # a state dict whose stack has another number of experts is not exported
    state = QWEN3_MOE.build_model(cfg, seed=3).state_dict()
    state["layers.0.mlp.experts.gate_proj"] = state["layers.0.mlp.experts.gate_proj"][:4]
    with pytest.raises(
        ValueError,
        match=r"layers.0.mlp.experts.gate_proj has shape \[4, 32, 64\] in the state dict; "
        r"the config implies \[8, 32, 64\]",
    ):
        save_hf(state, cfg, tmp_path / "four")


def test_the_weight_map_stacks_the_experts_for_convert(tmp_path):
    cfg = Qwen3MoeConfig(**TINY)
    src = QWEN3_MOE.build_model(cfg, seed=4)
    save_hf(src.state_dict(), cfg, tmp_path)
    where = hf_weight_map(tmp_path, cfg)
    assert set(where) == {n for n, _ in src.named_parameters()}
    assert sorted(where["layers.1.mlp.experts.up_proj"]) == list(range(8))
    for name, p in src.named_parameters():
        assert torch.equal(read_hf_parameter(where[name]), p.detach()), name


def test_a_rank_reads_only_the_experts_and_the_block_it_holds(tmp_path):
    """_read of a stacked parameter touches only the indices of its block's dim 0: a Source holding just
    experts 2 and 3 serves the block [2:4] (what expert parallel rank 1 of 4 holds)."""
    from tessera.models.hf import _open_each, _read

    cfg = Qwen3MoeConfig(**TINY)
    src = QWEN3_MOE.build_model(cfg, seed=5)
    save_hf(src.state_dict(), cfg, tmp_path)
    files = weight_files(tmp_path)
    some = {e: (f"model.layers.0.mlp.experts.{e}.down_proj.weight", tmp_path / "model.safetensors") for e in (2, 3)}
    with contextlib.ExitStack() as stack:
        handles = _open_each(files, stack)
        got = _read(handles, some, (slice(2, 4), slice(0, 64), slice(8, 24)))
        assert torch.equal(got, src.layers["0"].mlp.experts.down_proj.detach()[2:4, :, 8:24])
        assert _read(handles, some, (slice(3, 3), slice(0, 64), slice(0, 32))).shape == (0, 64, 32)


def _load_sharded(hf_path):
    """Rank function: tessera's model with each layer's experts as DTensors over 2 ranks (gate_proj sharded by
    expert: ep; up_proj on ffn and down_proj on its ffn input: tp; the router replicated), filled by
    load_hf_weights; this rank's local tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    cfg = read_hf_config(hf_path)
    model = QWEN3_MOE.build_model(cfg, seed=None)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    placements = {"gate_proj": Shard(0), "up_proj": Shard(1), "down_proj": Shard(2)}
    for layer in model.layers.values():
        for name, placement in placements.items():
            full = torch.full_like(getattr(layer.mlp.experts, name), float("nan"))
            setattr(layer.mlp.experts, name, torch.nn.Parameter(distribute_tensor(full, mesh, [placement])))
        layer.mlp.gate.weight = torch.nn.Parameter(
            distribute_tensor(torch.zeros_like(layer.mlp.gate.weight), mesh, [Replicate()])
        )
    load_hf_weights(model, hf_path)
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}


def test_expert_parallel_and_tp_shards_load_their_own_block(tmp_path):
    from tessera.launching.launch import run_ranks

    cfg = Qwen3MoeConfig(**TINY)
    src = QWEN3_MOE.build_model(cfg, seed=6)
    save_hf(src.state_dict(), cfg, tmp_path)
    full = {n: p.detach() for n, p in src.named_parameters()}
    ranks = run_ranks(_load_sharded, 2, tmp_path, timeout=120)
    for rank, got in enumerate(ranks):
        for layer in ("0", "1"):
            stem = f"layers.{layer}.mlp.experts"
            assert torch.equal(got[f"{stem}.gate_proj"], full[f"{stem}.gate_proj"][4 * rank : 4 * rank + 4])
            assert torch.equal(got[f"{stem}.up_proj"], full[f"{stem}.up_proj"][:, 16 * rank : 16 * rank + 16])
            assert torch.equal(got[f"{stem}.down_proj"], full[f"{stem}.down_proj"][:, :, 16 * rank : 16 * rank + 16])
            assert torch.equal(got[f"layers.{layer}.mlp.gate.weight"], full[f"layers.{layer}.mlp.gate.weight"])
        assert torch.equal(got["embed_tokens.weight"], full["embed_tokens.weight"])


# ----------------------------------------------------------------------------- config.json
def _config_json(**overrides):
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": VOCAB,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "use_sliding_window": False,
        "sliding_window": None,
        **overrides,
    }


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("mlp_only_layers", [1], "dense MLP layers among the MoE layers"),
        ("decoder_sparse_step", 2, "MoE on every other layer"),
        ("attention_bias", True, "biases in attention"),
        ("use_sliding_window", True, "sliding-window attention"),
        ("hidden_act", "gelu", "activation 'gelu'"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "rope type 'yarn'"),
    ],
)
def test_what_qwen3_moe_cannot_represent_is_refused_by_field_name(tmp_path, field, value, message):
    (tmp_path / "config.json").write_text(json.dumps(_config_json()))
    assert read_hf_config(tmp_path) == Qwen3MoeConfig(**TINY)
    (tmp_path / "config.json").write_text(json.dumps(_config_json(**{field: value})))
    with pytest.raises(ValueError, match=f"config.json: {field}: {message}.* is not supported"):
        read_hf_config(tmp_path)


def test_without_head_dim_config_json_means_hidden_size_over_heads_as_in_transformers(tmp_path):
    from transformers import Qwen3MoeConfig as HFQwen3MoeConfig
    from transformers import Qwen3MoeForCausalLM

    c = _config_json()
    del c["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps({**c, "hidden_size": 96}))
    assert read_hf_config(tmp_path).head_dim == 24
    with torch.device("meta"):
        theirs = Qwen3MoeForCausalLM(
            HFQwen3MoeConfig(**{k: v for k, v in c.items() if k != "architectures"} | {"hidden_size": 96})
        )
    assert theirs.model.layers[0].self_attn.q_norm.weight.shape == (24,)


def test_what_qwen3_moe_cannot_export_is_refused_with_the_field():
    assert hf_config_dict(Qwen3MoeConfig(**TINY))["num_experts"] == 8
    with pytest.raises(ValueError, match=r"score_func='sigmoid' has no Hugging Face Qwen3-MoE form .*softmax routing"):
        hf_config_dict(Qwen3MoeConfig(**TINY, score_func="sigmoid"))
    with pytest.raises(ValueError, match=r"shared_ffn_dim=16 has no Hugging Face Qwen3-MoE form .*no shared expert"):
        hf_config_dict(Qwen3MoeConfig(**TINY, shared_ffn_dim=16))


# ----------------------------------------------------------------------------- the block against its definition
def _naive_moe(x, gate, w1, w3, w2, top_k, norm_topk):
    """The MoE block's definition, token by token in float64: softmax scores, the top k, renormalized or not,
    the weighted sum of the chosen experts' SwiGLU."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        scores = torch.softmax(gate @ x[t], dim=-1)
        chosen = sorted(range(scores.shape[0]), key=lambda e: -scores[e].item())[:top_k]
        weights = scores[chosen] / (scores[chosen].sum() if norm_topk else 1.0)
        for w, e in zip(weights, chosen):
            out[t] += w * (w2[e] @ (F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
    return out


@pytest.mark.parametrize("norm_topk", [True, False])
def test_the_moe_block_is_its_float64_definition(norm_topk):
    cfg = Qwen3MoeConfig(**TINY, norm_topk_prob=norm_topk)
    block = _ours(cfg, seed=8).double().layers["1"].mlp
    x = torch.randn(2, 9, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = block(x)
    e = block.experts
    want = _naive_moe(
        x.reshape(-1, 64),
        block.gate.weight.detach(),
        e.gate_proj.detach(),
        e.up_proj.detach(),
        e.down_proj.detach(),
        cfg.top_k,
        norm_topk,
    ).view_as(x)
    assert got.dtype == torch.float64
    _close(got, want, 1e-10)


def test_a_router_that_sends_every_token_to_one_expert_runs_them_all_there():
    """Dropless: with the router forced to expert 5 and top 1, every token is processed, by expert 5 alone,
    with weight 1.0."""
    cfg = Qwen3MoeConfig(**{**TINY, "top_k": 1})
    block = _ours(cfg, seed=9).double().layers["0"].mlp
    x = torch.randn(3, 11, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[..., 0] = x[..., 0].abs() + 1.0  # the router sees a positive first feature in every token
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[5, 0] = 100.0  # logit 5 >= 100, every other 0
        block.tokens_per_expert.zero_()
        got = block(x)
    e = block.experts
    w1, w3, w2 = e.gate_proj[5].detach(), e.up_proj[5].detach(), e.down_proj[5].detach()
    want = (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
    assert torch.equal(block.tokens_per_expert, torch.tensor([0.0] * 5 + [33.0] + [0.0] * 2, dtype=torch.float64))
    _close(got, want, 1e-12)


@pytest.mark.parametrize("counts", [[3, 0, 2, 0, 4], [0, 0, 5, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
def test_grouped_mms_per_expert_loop_is_the_naive_product(counts):
    g = torch.Generator().manual_seed(sum(counts))
    x = torch.randn(sum(counts), 6, dtype=torch.float64, generator=g)
    w = torch.randn(len(counts), 6, 7, dtype=torch.float64, generator=g)
    got = grouped_mm(x, w, torch.tensor(counts), use_grouped=False)
    want = torch.zeros(sum(counts), 7, dtype=torch.float64)
    row = 0
    for group, n in enumerate(counts):
        for _ in range(n):
            want[row] = sum(x[row, k] * w[group, k] for k in range(6))
            row += 1
    assert got.shape == (sum(counts), 7) and got.dtype == torch.float64
    if sum(counts):  # every group empty: no rows at all
        _close(got, want, 1e-12)
    assert torch.equal(grouped_mm(x, w, torch.tensor(counts)), got)  # on CPU the default is the loop

"""Hugging Face Llama checkpoints: a tiny LlamaForCausalLM made here (random weights, no download) loads
into tessera on one process, tp2 and dp2 x tp2 with transformers' logits; tessera's export loads back into
transformers with tessera's logits; bad directories are named."""

import json

import pytest
import torch

from helpers import NEEDS_TRANSFORMERS, small_config, cli_here
from tessera.launching.launch import run_ranks

pytestmark = NEEDS_TRANSFORMERS


def _tiny_llama(path, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **overrides,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    _tiny_llama(path)
    return path


TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))


def _tessera_logits(hf_path, tp_first):
    """Rank function: the model of --init-from-hf on this layout, its full logits for TOKENS on rank 0."""
    import torch.distributed as dist

    from tessera.config import Config
    from tessera.trainer import Trainer
    from tessera.models.hf import load_hf_weights
    from tessera.parallel.tensor import full_tensor  # noqa: F401

    world = dist.get_world_size()
    layout = dict(tp=2, dp=world // 2) if world > 1 else {}
    config = Config.create(init_from_hf=str(hf_path), seq_len=24, global_batch=2, steps=1, quiet=True, **layout)
    trainer = Trainer(config, torch.device("cpu"))
    for part in trainer.parts:
        load_hf_weights(part, hf_path)
    model = trainer.parts[0]
    with torch.no_grad():
        logits = model(TOKENS)
        if config.layout.tp > 1:  # vocab-parallel logits: gather the tp slices
            tp = trainer.meshes.tp.get_group()
            pieces = [torch.empty_like(logits) for _ in range(config.layout.tp)]
            dist.all_gather(pieces, logits.contiguous(), group=tp)
            logits = torch.cat(pieces, dim=-1)[..., :96]
    return logits


def test_a_transformers_llama_loads_on_one_process_tp2_and_dp2xtp2_with_its_logits(hf_dir):
    from transformers import LlamaForCausalLM

    want = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()(TOKENS).logits.detach()
    for world in (1, 2, 4):
        got = run_ranks(_tessera_logits, world, hf_dir, True, timeout=120)[0]
        err = (got - want).abs().max().item()
        assert err <= 1e-5 * max(1.0, want.abs().max().item()), (world, err)


def test_llama3_rope_scaling_loads_with_transformers_logits_and_exports_back(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tessera.models.hf import hf_config_dict, read_hf_config

    torch.manual_seed(0)
    rope = {
        "rope_type": "llama3",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }  # short: the 24-token input reaches the scaled band
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters=rope,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(tmp_path / "l3", safe_serialization=True)
    ours = read_hf_config(tmp_path / "l3")
    assert dict(ours.rope_scaling)["factor"] == 8.0 and hf_config_dict(ours)["rope_parameters"]["rope_type"] == "llama3"
    want = model(TOKENS).logits.detach()
    got = run_ranks(_tessera_logits, 1, tmp_path / "l3", True, timeout=120)[0]
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
    # the scaling matters at these positions: the same weights with plain RoPE give other logits
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "model.safetensors").write_bytes((tmp_path / "l3" / "model.safetensors").read_bytes())
    config = json.loads((tmp_path / "l3" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    plain = run_ranks(_tessera_logits, 1, tmp_path / "plain", True, timeout=120)[0]
    assert (plain - want).abs().max().item() > 1e-3


def test_train_from_hf_then_export_to_hf_loads_back_into_transformers(hf_dir, tmp_path):
    from transformers import LlamaForCausalLM

    from tessera.cli import main
    from tessera.training.run import train

    from tessera.data.tokens import write_shard

    ckpt = tmp_path / "ckpt"
    (tmp_path / "tokens").mkdir()
    ids = torch.randint(0, 96, (2000,), generator=torch.Generator().manual_seed(2)).tolist()
    write_shard(tmp_path / "tokens" / "shard_00000", ids, vocab_size=96, separator=0)  # ids of the model's vocabulary
    train(
        small_config(
            init_from_hf=str(hf_dir),
            seq_len=24,
            global_batch=4,
            steps=2,
            dp=2,
            tp=2,
            data=str(tmp_path / "tokens"),
            checkpoint_dir=str(ckpt),
            checkpoint_every=2,
            vocab_size=None,
            model="debug",
        )
    )
    assert main(["export", str(ckpt), "--to-hf", str(tmp_path / "out")]) == 0
    exported = LlamaForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32).eval()
    theirs = exported(TOKENS).logits.detach()
    ours = run_ranks(_tessera_logits, 1, tmp_path / "out", True, timeout=120)[0]  # tessera reading its own export
    assert (theirs - ours).abs().max().item() <= 1e-5 * max(1.0, theirs.abs().max().item())
    before = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()(TOKENS).logits.detach()
    assert not torch.allclose(before, theirs)  # the two training steps changed the weights


def test_convert_writes_tesseras_names(hf_dir, tmp_path):
    from tessera.cli import main
    from tessera.checkpointing.checkpoint import read_safetensors

    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "t.safetensors")]) == 0
    tensors = read_safetensors(tmp_path / "t.safetensors")
    assert {
        "tok_embeddings.weight",
        "layers.1.attention.wk.weight",
        "layers.0.feed_forward.w3.weight",
        "output.weight",
    } <= set(tensors)
    assert tensors["layers.1.attention.wk.weight"].shape == (32, 64)


def test_bad_hugging_face_input_is_one_clear_line(hf_dir, tmp_path):
    # an unsupported architecture
    other = tmp_path / "gpt"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(
        ValueError, match=r"config.json: architecture 'GPT2LMHeadModel' \(model_type 'gpt2'\) is not supported"
    ):
        small_config(init_from_hf=str(other)).check()
    # tied embeddings and rope scaling, refused by name
    cfg = json.loads((hf_dir / "config.json").read_text())
    for field, value, message in (
        ("tie_word_embeddings", True, "tied embeddings"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 8.0}, "rope type 'yarn'"),
    ):
        d = tmp_path / field
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(ValueError, match=f"{field}: .*{message}.* is not supported"):
            small_config(init_from_hf=str(d)).check()
    # weights whose shapes the config does not imply
    bad = tmp_path / "shapes"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    (bad / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: model.layers.0.mlp.down_proj.weight has shape \[64, 128\], "
        r"config.json implies \[64, 96\]",
    ):
        small_config(init_from_hf=str(bad)).check()
    # a --model that disagrees with config.json
    with pytest.raises(ValueError, match=r"--model small does not match the Hugging Face config.json \(dim 64 vs 256"):
        small_config(init_from_hf=str(hf_dir), model="small").check()


def test_the_readme_fine_tuning_commands_run_as_written(hf_dir, tmp_path):
    """The four commands of the README, on the tiny Llama, a tokenizer made here and two documents; only
    the paths and the sizes are swapped for the test's."""
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    readme = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
    block = re.search(r"## Fine-tuning a Hugging Face Llama on your data.*?```bash\n(.*?)```", readme, re.S).group(1)
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 4
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["hello tessera world"] * 50 + ["pipelines and rings"] * 50,
        trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "</s>"]),
    )
    llama = tmp_path / "llama"
    llama.mkdir()
    for f in hf_dir.iterdir():
        (llama / f.name).write_bytes(f.read_bytes())
    tok.save(str(llama / "tokenizer.json"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.jsonl").write_text(
        "\n".join(json.dumps({"text": "hello tessera world " * 40}) for _ in range(8))
    )
    sizes = {
        "--seq-len 2048": "--seq-len 32",
        "--global-batch 16": "--global-batch 4",
        "--steps 1000": "--steps 2",
        "--checkpoint-every 100": "--checkpoint-every 2",
    }
    for line in lines:
        for a, b in sizes.items():
            line = line.replace(a, b)
        argv = shlex.split(line)
        if argv[0] == "python":
            argv[0] = sys.executable
        argv = [str(tmp_path / "docs" / "a.jsonl") if a == "docs/*.jsonl" else a for a in argv]
        if argv[0] == "tessera":  # the command's own main() in this process (tests/helpers.py)
            out = cli_here(*argv[1:], cwd=tmp_path)
        else:
            out = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert out.returncode == 0, (line, out.stderr[-2000:])
    assert (tmp_path / "finetuned" / "config.json").exists()


@pytest.fixture
def umask_022():
    import os

    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize(
    "preset, architecture",
    [("qwen3-moe-debug", "Qwen3MoeForCausalLM"), ("qwen3-debug", "Qwen3ForCausalLM"), ("debug", "LlamaForCausalLM")],
)
def test_export_to_hf_names_the_familys_architecture_and_writes_readable_files(
    tmp_path, monkeypatch, umask_022, preset, architecture
):
    """Issue 40: `export --to-hf` of a Qwen3-MoE checkpoint said it wrote "a Hugging Face Llama directory:
    LlamaForCausalLM.from_pretrained loads it", and its model.safetensors was -rw------- beside a -rw-r--r--
    config.json. The checkpoint's sharded read (DCP, tested in test_checkpoint.py) is stood in for by the full
    state dict it gives, so that the command runs in process."""
    import tessera.checkpointing.checkpoint as checkpoint
    from tessera.models import get_preset
    from tessera.models.safetensors_io import write_safetensors
    from tessera.models.spec import spec_of

    cfg = get_preset(preset)
    # (cloned: a tied head shares its embedding's storage, which safetensors refuses; DCP reads them apart)
    state = {k: v.clone() for k, v in spec_of(cfg).build_model(cfg, "cpu", 0).state_dict().items()}
    family = spec_of(cfg).name

    def exported(path, out):
        write_safetensors(state, out, {"preset": preset, "step": "3"})
        return {"model": {"preset": preset, "family": family, "config": cfg.as_dict()}, "step": 3}

    monkeypatch.setattr(checkpoint, "export_checkpoint", exported)
    out = cli_here("export", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    assert out.stdout == (
        f"wrote {tmp_path / 'hf'}: model {preset} at step 3 (a Hugging Face {architecture} directory: "
        f"transformers' {architecture}.from_pretrained loads it)\n"
    )
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [architecture]
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "hf" / name).stat().st_mode & 0o777 == 0o644, name


def test_export_help_names_no_one_family():
    text = " ".join(cli_here("export", "--help").stdout.split())
    assert "a Hugging Face directory of the checkpoint's model family" in text
    assert "Hugging Face Llama directory" not in text


def test_safetensors_files_get_the_permissions_of_any_file_the_process_creates(tmp_path):
    """0o666 less the umask (safetensors' own writer makes its file owner-only), a stale temporary file's mode
    not inherited; what `tessera export --out` and `tessera convert` write."""
    import os

    from tessera.models.safetensors_io import read_safetensors, write_safetensors

    file = tmp_path / "t.safetensors"
    for umask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        (tmp_path / "t.safetensors.tmp").touch(mode=0o600)  # left by an interrupted write
        old = os.umask(umask)
        try:
            write_safetensors({"w": torch.ones(2)}, file)
        finally:
            os.umask(old)
        assert file.stat().st_mode & 0o777 == mode, (oct(umask), oct(file.stat().st_mode))
        assert torch.equal(read_safetensors(file)["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"]


def test_convert_writes_a_file_others_can_read_under_umask_022(hf_dir, tmp_path, umask_022):
    from tessera.cli import main

    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "t.safetensors")]) == 0
    assert (tmp_path / "t.safetensors").stat().st_mode & 0o777 == 0o644

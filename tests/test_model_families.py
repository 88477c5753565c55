"""The model families as checkpoints and the parallel plans see them, held to what they were before the families
were composed from shared blocks (issue 39 item 3): every preset's state-dict keys, shapes and dtypes (the full
list for the debug presets, a digest for the rest), each debug model's module names and the tp style each gets,
the spec's seams, and a forward + backward on each debug preset, logits and gradients bitwise.

tests/data/model_families.json holds what was captured; `python tests/test_model_families.py --write` captures
it again, which only a deliberate change of a family's checkpoints or numerics should do. Bitwise equality holds
on the torch version and CPU (the features its GEMM libraries choose kernels by) it was captured on; elsewhere
(another torch, another ISA: other kernels may sum in another order) each tensor's float64 norm and its dot with a
fixed random vector must agree to 1e-5 relative (this file, captured on an AMX CPU, against an earlier capture on
a CPU torch also calls AVX512, whose kernels summed to other last bits: 1.1e-6 at most).

The last test keeps the families composed from the shared blocks (models/decoder.py, attention.py, mlp.py,
moe.py): no run of six or more identical lines (whitespace stripped, blank lines skipped) between two family
files, the measure of issue 39 item 3 (`duplicates --repo models` shows them, and runs alike but for names too).
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import pickle
import platform
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tessera.models.spec import families, get_preset
from tessera.parallel.tp_plan import matches

DATA = Path(__file__).resolve().parent / "data" / "model_families.json"
LLAMA3_ROPE = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64}
# forward + backward cases: each family's debug presets, plus the RoPE and head variants they leave out
NUMERICS = {
    "debug": ("debug", {}),
    "debug-llama3-rope": ("debug", {"rope_scaling": LLAMA3_ROPE}),
    "qwen3-debug": ("qwen3-debug", {}),
    "qwen3-debug-untied": ("qwen3-debug", {"tie_word_embeddings": False}),
    "qwen3-moe-debug": ("qwen3-moe-debug", {}),
    "qwen3-moe-shared-debug": ("qwen3-moe-shared-debug", {}),
}


def _debug_presets() -> list[str]:
    return [p for spec in families().values() for p in spec.presets if p.endswith("debug")]


def _all_presets() -> list[str]:
    return [p for spec in families().values() for p in spec.presets]


def _spec_of_preset(preset: str):
    return next(spec for spec in families().values() if preset in spec.presets)


def state_dict_entries(preset: str) -> list[list]:
    """[key, shape, dtype] of the preset's model (built on meta), in state_dict() order."""
    model = _spec_of_preset(preset).build_model(get_preset(preset), device="meta")
    return [[k, list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in model.state_dict().items()]


def _digest(entries: list) -> str:
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def module_styles(preset: str) -> list[list]:
    """[module name, the tp style the spec's plan gives it (first match), or None] for every module."""
    spec = _spec_of_preset(preset)
    model = spec.build_model(get_preset(preset), device="meta")
    style = {n: next((s for p, s in spec.tp_plan if matches(p, n)), None) for n, _ in model.named_modules() if n}
    return [[n, s] for n, s in style.items()]


def spec_seams() -> dict[str, dict]:
    """What parallel/ reads of each spec besides the plan: blocks, pipeline split, attention slots, head, moe."""
    return {
        s.name: {
            "blocks": s.blocks,
            "pipeline": [list(s.pipeline.first), s.pipeline.blocks, list(s.pipeline.last)],
            "attention": s.attention,
            "head": s.head,
            "moe": s.moe,
        }
        for s in families().values()
    }


# the CPU features GEMM libraries pick their kernels by (MKL's and oneDNN's code paths): two machines that torch
# calls AVX512 alike, one with AMX and AVX512-FP16, summed a model's matmuls to different last bits
KERNEL_FEATURES = re.compile(r"avx\d*|avx512\w*|avx_vnni\w*|amx\w*|fma|f16c")


def cpu_features() -> list[str]:
    """The CPU flags of KERNEL_FEATURES this machine has (Linux's /proc/cpuinfo; none found elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return sorted(f for f in set(flags) if KERNEL_FEATURES.fullmatch(f))


def environment() -> dict:
    return {
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "cpu_features": cpu_features(),
        "machine": platform.machine(),
    }


def forward_backward(case: str) -> dict[str, torch.Tensor]:
    """Logits and every gradient of a seeded model's cross-entropy on fixed tokens, on one CPU thread."""
    preset, overrides = NUMERICS[case]
    cfg = get_preset(preset, **overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one summation order, whatever the machine's core count
    try:
        model = _spec_of_preset(preset).build_model(cfg, seed=0)
        g = torch.Generator().manual_seed(1)
        tokens, targets = (torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(2))
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    finally:
        torch.set_num_threads(threads)
    return {"logits": logits.detach(), **{n: p.grad for n, p in model.named_parameters()}}


def fingerprints(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Each tensor's float64 norm and dot with a fixed N(0, 1) vector: what other kernels keep to ~1e-6."""
    out = {}
    for name, t in tensors.items():
        x = t.double().flatten()
        w = torch.randn(x.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        out[name] = [x.norm().item(), (x @ w).item()]
    return out


def sha256(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def capture() -> dict:
    numerics = {}
    for case in NUMERICS:
        tensors = forward_backward(case)
        numerics[case] = {"sha256": sha256(tensors), "fingerprints": fingerprints(tensors)}
    return {
        "environment": environment(),
        "state_dicts": {p: state_dict_entries(p) for p in _debug_presets()},
        "state_dict_digests": {p: _digest(state_dict_entries(p)) for p in _all_presets()},
        "module_styles": {p: module_styles(p) for p in _debug_presets()},
        "spec_seams": spec_seams(),
        "numerics": numerics,
    }


def dump(obj, indent: str = "") -> str:
    """JSON with one line per state-dict entry, module or fingerprint: a list that holds a scalar on one line."""
    flat = isinstance(obj, list) and any(not isinstance(x, (dict, list)) for x in obj)
    if not isinstance(obj, (dict, list)) or flat:
        return json.dumps(obj)
    inner = indent + " "
    items = obj.items() if isinstance(obj, dict) else ((None, x) for x in obj)
    body = ",\n".join(inner + (f"{json.dumps(k)}: " if k is not None else "") + dump(v, inner) for k, v in items)
    brackets = "{}" if isinstance(obj, dict) else "[]"
    return f"{brackets[0]}\n{body}\n{indent}{brackets[1]}"


@pytest.fixture(scope="module")
def captured() -> dict:
    return json.loads(DATA.read_text())


def test_every_debug_preset_has_the_state_dict_keys_shapes_and_dtypes_captured(captured):
    assert sorted(captured["state_dicts"]) == sorted(_debug_presets())
    for preset, want in captured["state_dicts"].items():
        assert state_dict_entries(preset) == want, preset


def test_every_preset_has_the_state_dict_captured(captured):
    assert sorted(captured["state_dict_digests"]) == sorted(_all_presets())
    for preset, want in captured["state_dict_digests"].items():
        assert _digest(state_dict_entries(preset)) == want, preset


def test_the_parallel_plans_see_the_same_modules_and_styles(captured):
    for preset, want in captured["module_styles"].items():
        assert module_styles(preset) == want, preset
    assert spec_seams() == captured["spec_seams"]


@pytest.mark.parametrize("case", list(NUMERICS))
def test_forward_and_backward_are_bitwise_what_they_were(captured, case):
    want = captured["numerics"][case]
    if torch.__version__.split("+")[0] != captured["environment"]["torch"].split("+")[0]:
        pytest.skip(
            f"captured on torch {captured['environment']['torch']}: torch {torch.__version__}'s seeded init draws "
            f"other weights (debug's logits differ by ~3% on 2.11), so there is no like to compare with"
        )
    tensors = forward_backward(case)
    assert sorted(tensors) == sorted(want["fingerprints"])
    if environment() == captured["environment"]:
        assert sha256(tensors) == want["sha256"], "logits or gradients moved"
        return
    for name, (norm, dot) in fingerprints(tensors).items():
        want_norm, want_dot = want["fingerprints"][name]
        assert abs(norm - want_norm) <= 1e-5 * want_norm, name
        assert abs(dot - want_dot) <= 1e-5 * want_norm, name


def test_every_spec_travels_to_the_ranks_by_pickle():
    """The multi-rank harness ships specs to the ranks pickled: no closure or lambda in one."""
    for spec in families().values():
        copy = pickle.loads(pickle.dumps(spec))
        cfg = get_preset(next(iter(spec.presets)))
        name = next(n for n, _ in spec.build_model(cfg, device="meta").named_parameters() if "layers.0" in n)
        assert copy.init_std(name, cfg) == spec.init_std(name, cfg)
        assert spec.hf is None or copy.hf.from_hf(copy.hf.to_hf(name)) == spec.hf.from_hf(spec.hf.to_hf(name))


def test_a_family_is_its_names_and_blocks():
    """A new family written on the shared blocks: its names alone place its parameters, and its spec's pipeline
    split, attention slots and tp plan follow them (what DeepSeek-V3 and gpt-oss will be written as)."""
    from torch import nn

    from tessera.models.attention import AttentionNames, GroupedQueryAttention, attention_tp_plan
    from tessera.models.decoder import DecoderLM, DecoderNames, DepthScaledInit, decoder_shape, decoder_spec
    from tessera.models.decoder import decoder_tp_plan
    from tessera.models.layers import Rotary
    from tessera.models.mlp import MLPNames, SwiGLU, swiglu_tp_plan

    cfg = get_preset("qwen3-debug", n_layers=1)
    attention, mlp = AttentionNames("q", "k", "v", "proj"), MLPNames("fc_gate", "fc_in", "fc_out")

    class Toy(DecoderLM):
        names = DecoderNames("wte", "final_norm", "head", "pre_attn_norm", "attn", "pre_ffn_norm", "ffn")

        def __init__(self, cfg):
            super().__init__(cfg, Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta))

        def build_attention(self, cfg, layer: int) -> nn.Module:
            return GroupedQueryAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, attention)

        def build_mlp(self, cfg, layer: int) -> nn.Module:
            return SwiGLU(cfg.dim, cfg.ffn_dim, mlp)

    plan = decoder_tp_plan(Toy.names, attention_tp_plan(attention), swiglu_tp_plan(mlp))
    spec = decoder_spec("toy", type(cfg), Toy, plan, DepthScaledInit(("proj", "fc_out")), decoder_shape, {})
    model = spec.build_model(cfg, seed=0)
    assert [n for n, _ in model.named_parameters()] == [
        "wte.weight",
        *(f"layers.0.{n}.weight" for n in ("pre_attn_norm", "attn.q", "attn.k", "attn.v", "attn.proj", "pre_ffn_norm")),
        *(f"layers.0.ffn.{n}.weight" for n in ("fc_gate", "fc_in", "fc_out")),
        "final_norm.weight",
        "head.weight",
    ]
    assert spec.pipeline.first == ("wte",) and spec.pipeline.last == ("final_norm", "head")
    assert spec.attention == "layers.*.attn.core"
    styles = {n: next((s for p, s in plan if matches(p, n)), None) for n, _ in model.named_modules()}
    assert [styles[n] for n in ("layers.0.attn.k", "layers.0.ffn.fc_out", "head")] == [
        "kv",
        "rowwise",
        "colwise_gather",
    ]
    scaled = cfg.init_std / 2**0.5  # 1/sqrt(2 * n_layers) on the output projections
    names = ("attn.proj", "ffn.fc_out", "attn.q", "pre_attn_norm")
    assert [spec.init_std(f"layers.0.{n}.weight", cfg) for n in names] == [scaled, scaled, cfg.init_std, "ones"]
    assert model(torch.randint(0, cfg.vocab_size, (1, 8))).shape == (1, 8, cfg.vocab_size)


# ----------------------------------------------------------------------------- the families stay composed
def _code_lines(path: Path) -> list[tuple[int, str]]:
    lines = ((n, line.strip()) for n, line in enumerate(path.read_text().splitlines(), 1))
    return [(n, s) for n, s in lines if s]


def repeated_runs(a: Path, b: Path, min_lines: int = 6) -> list[str]:
    """The maximal runs of `min_lines` or more identical lines (stripped, blank lines skipped) in both files."""
    A, B = _code_lines(a), _code_lines(b)
    runs, prev = [], {}
    for i in range(len(A) + 1):
        cur = {j: prev.get(j - 1, 0) + 1 for j in range(len(B)) if i < len(A) and A[i][1] == B[j][1]}
        for j, n in prev.items():
            if n >= min_lines and not cur.get(j + 1):
                runs.append(f"{a.name}:{A[i - n][0]}-{A[i - 1][0]} ~ {b.name}:{B[j - n + 1][0]}-{B[j][0]}")
        prev = cur
    return runs


def family_files() -> list[Path]:
    return sorted({Path(inspect.getfile(spec.build)) for spec in families().values()})


def test_no_family_file_repeats_six_lines_of_another():
    files = family_files()
    assert len(files) >= 3, files
    runs = [r for a, b in itertools.combinations(files, 2) for r in repeated_runs(a, b)]
    assert not runs, "family files repeat each other (compose the shared blocks instead):\n" + "\n".join(runs)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_model_families.py --write   (captures tests/data/model_families.json)")
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(dump(capture()) + "\n")
    print(f"wrote {DATA}")


def test_the_model_flags_help_names_every_registered_preset():
    """--model's help is written by hand (sections.py loads no model code): it must not fall behind the registry."""
    import tessera.models  # noqa: F401 (registers every family)
    from tessera.models.spec import families
    import dataclasses

    from tessera.training.sections import ModelSection

    text = next(f.metadata["doc"] for f in dataclasses.fields(ModelSection) if f.name == "preset")
    for name, spec in families().items():
        assert f"{name} (" in text, name
        for preset in spec.presets:
            assert preset in text, (name, preset)

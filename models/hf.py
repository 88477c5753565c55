"""Hugging Face checkpoints in and out for any registered family with an `HFAdapter` (models/spec.py):
config.json <-> the family's config, HF parameter names <-> the family's, safetensors weights in and out.

config.json's model_type picks the family (`spec.spec_for_hf`); the family's adapter reads the rest and
refuses, by field name, what its modules cannot represent. Everything else here goes through the spec:
parameter names through `to_hf`/`from_hf`, shapes from the model built on the meta device. Tied weights
(one nn.Parameter under two names, e.g. a head tied to the token embedding) are found by identity on that
meta build: tessera's name is the owner's (`named_parameters()`'s first), a checkpoint may hold the
parameter under either name, and an export writes it once, under the owner's name, as transformers
does (a tied checkpoint has no lm_head.weight). A stacked parameter (a family's experts, (E, ...)) is E
tensors in a checkpoint: `from_hf` gives (stacked name, index) for each, `to_hf` a template with `{}` where
the index goes; it is read by stacking them along dim 0 and written one tensor per index. A rank reads only
its own block of each parameter from the memory-mapped safetensors files (of a stacked one, only its
indices: its experts under expert parallel); a parameter sharded in strides, FSDP over tp, is read whole,
one at a time; no process ever holds the full state dict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tessera.topology.shapes import ModelShape

from .init import one_process_name
from .safetensors_io import write_safetensors
from .spec import HFAdapter, ModelSpec, all_presets, families, get_spec, spec_for_hf, spec_of

# Where a parameter is in a checkpoint: (HF name, file), or for a stacked parameter index -> (HF name, file)
# of each of its slices along dim 0.
Source = tuple[str, Path] | dict[int, tuple[str, Path]]


def _spec(model: Any) -> ModelSpec:
    """The spec of a ModelSpec, a family's config, or a model (its `.config`)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, nn.Module):
        model = model.config
    return spec_of(model)


def _adapter(model: Any) -> HFAdapter:
    spec = _spec(model)
    if spec.hf is None:
        raise ValueError(f"model family {spec.name!r} has no Hugging Face adapter (its ModelSpec.hf is None)")
    return spec.hf


def hf_to_tessera_name(name: str, model: Any) -> str | tuple[str, int] | None:
    """A Hugging Face parameter name -> the family's (None: not a parameter, e.g. rotary buffers; (name, index):
    one slice of a stacked parameter). `model`: the family's config, spec or model. ValueError for a name the
    family does not know."""
    return _adapter(model).from_hf(name)


def tessera_to_hf_name(name: str, model: Any) -> str:
    """The family's parameter name -> Hugging Face's (a stacked parameter's: a template, `{}` for the index).
    `model`: the family's config, spec or model."""
    return _adapter(model).to_hf(name)


def _hf_names(name: str, shape: tuple[int, ...], cfg: Any) -> dict[int | None, str]:
    """The HF tensors of one parameter: {None: HF name}, or a stacked one's {index: HF name} for each index."""
    hf = tessera_to_hf_name(name, cfg)
    return {i: hf.format(i) for i in range(shape[0])} if "{}" in hf else {None: hf}


def _slices(src: Source | None) -> dict[int | None, tuple[str, Path]]:
    """A Source as {index or None: (HF name, file)}, what `_hf_names` keys are compared with."""
    if src is None:
        return {}
    if isinstance(src, dict):
        return {i: s for i, s in src.items()}
    return {None: src}


def _lacks(name: str, shape: tuple[int, ...], src: Source | None, cfg: Any) -> list[str]:
    """The HF names of the tensors of parameter `name` (each index's, if stacked) that `src` does not hold."""
    held = _slices(src)
    return [hf for i, hf in _hf_names(name, shape, cfg).items() if i not in held]


# ----------------------------------------------------------------------------- config.json
def _named(flag: str, directory: Any) -> str:
    """How the user named the directory, by the parameter that did: "init_from_hf=DIR", or "preset=hf:DIR"
    (flag "preset=hf:"); the CLI writes its flags for them (--init-from-hf DIR, --model hf:DIR)."""
    return f"{flag}{directory}" if flag.endswith(":") else f"{flag}={directory}"


def _takes(flag: str) -> str:
    """The parameter that named the directory, without the directory: `init_from_hf`, or preset=hf:DIR."""
    return f"{flag}DIR" if flag.endswith(":") else f"`{flag}`"


def read_hf_config(directory: str | os.PathLike, flag: str = "init_from_hf") -> Any:
    """The family's config from a Hugging Face config.json, the family chosen by its model_type;
    ValueError naming the file and the field for what the family cannot represent. `flag`: the parameter
    that named the directory, for the messages (`tessera convert` passes from_hf; a model named hf:DIR is
    "preset=hf:")."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        if not str(directory) or not Path(directory).exists():
            raise ValueError(
                f"{_named(flag, str(directory) or repr(''))}: no such directory; name a Hugging Face model directory "
                f"(config.json, model.safetensors)"
            )
        if not Path(directory).is_dir():
            raise ValueError(
                f"{_named(flag, directory)} is a file; name a Hugging Face model directory (config.json, "
                f"model.safetensors)"
            )
        raise ValueError(f"{_named(flag, directory)}: no config.json in it (a Hugging Face model directory)")
    try:
        c = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(c, dict):
        raise ValueError(f"{path}: not a Hugging Face config (a JSON object)")
    model_type = c.get("model_type")
    known = {s.hf.model_type: s.hf.architecture for s in families().values() if s.hf is not None}
    if model_type not in known:
        arch = (c.get("architectures") or [model_type])[0]
        raise ValueError(
            f"{path}: architecture {arch!r} (model_type {model_type!r}) is not supported; tessera loads "
            + ", ".join(f"{a} (model_type {t!r})" for t, a in known.items())
        )
    try:
        return _adapter(spec_for_hf(model_type, str(path))).read_config(c, str(path))
    except KeyError as e:  # the family's reader indexes the fields it needs
        raise ValueError(
            f"{path}: no {e.args[0]!r} field (the {model_type} config needs it); "
            f"{_takes(flag)} takes a "
            f"complete Hugging Face config.json"
        ) from None
    except (TypeError, AttributeError, ZeroDivisionError) as e:
        raise ValueError(
            f"{path}: a field holds a value of the wrong kind ({e}); "
            f"{_takes(flag)} takes a Hugging Face "
            f"config.json as transformers writes it"
        ) from None


def hf_config_dict(cfg: Any, dtype: str = "float32") -> dict[str, Any]:
    """The config.json contents of a family's config (`dtype` names the weights' dtype)."""
    return _adapter(cfg).config_dict(cfg, dtype)


def compare_with_preset(hf: Any, preset: Any, preset_name: str) -> None:
    """ValueError unless a preset has the sizes (and family) of the config read from config.json."""
    a, b = _spec(hf).shape(hf), _spec(preset).shape(preset)
    differ = [
        f"{f.name} {getattr(a, f.name)} vs {getattr(b, f.name)}"
        for f in dataclasses.fields(ModelShape)
        if getattr(a, f.name) != getattr(b, f.name)
    ]
    if differ:
        raise ValueError(
            f"preset={preset_name} does not match the Hugging Face config.json ({'; '.join(differ)}); "
            f"drop `preset`: the config is read from config.json"
        )


def config_from_manifest(model: dict[str, Any]) -> Any:
    """The config a checkpoint manifest's "model" entry ({"preset", "config"}, maybe "family") describes.
    The family: the entry's own, else the preset's, else an hf:DIR's config.json model_type, else the one
    registered family whose config takes exactly the saved fields."""
    saved = dict(model["config"])
    family = model.get("family")
    preset = str(model.get("preset", ""))
    if family is None and preset.lower() in all_presets():
        family = all_presets()[preset.lower()][0].name
    if family is None and preset.startswith("hf:") and (Path(preset[3:]) / "config.json").is_file():
        with contextlib.suppress(ValueError, OSError):
            family = _spec(read_hf_config(preset[3:])).name
    if family is None:
        fits = []
        for spec in families().values():
            fields = dataclasses.fields(spec.config_type)
            required = {
                f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            }
            if set(saved) <= {f.name for f in fields} and required <= set(saved):
                fits.append(spec.name)
        if len(fits) != 1:
            raise ValueError(
                f"the checkpoint's model {preset!r} (fields {sorted(saved)}) is not one registered family's "
                f"config (matching: {fits or 'none'})"
            )
        family = fits[0]
    return get_spec(family).config_type(**saved)


# ----------------------------------------------------------------------------- names and shapes
def _parameters(cfg: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[str, ...]]]:
    """The model of `cfg` built on meta: (owner name -> shape, every name -> the names of its parameter,
    the owner first). A tied parameter has two names; the owner is `named_parameters()`'s."""
    model = _spec(cfg).build_model(cfg, device="meta")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    buffers = _hf_buffers(model, cfg)
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    groups: dict[str, tuple[str, ...]] = {}
    for names in by_id.values():
        owner = next(n for n in names if n in shapes)
        group = (owner, *[n for n in names if n != owner])
        groups.update({n: group for n in names})
    shapes.update(buffers)
    groups.update({n: (n,) for n in buffers})
    return shapes, groups


def _hf_buffers(model: nn.Module, cfg: Any) -> dict[str, tuple[int, ...]]:
    """The persistent buffers a family's checkpoints hold (the adapter names them: DeepSeek-V3's routing bias,
    transformers' e_score_correction_bias), read and written as its parameters are; name -> shape."""
    persistent = set(model.state_dict())
    out = {}
    for n, b in model.named_buffers():
        if n in persistent:
            try:
                tessera_to_hf_name(n, cfg)
            except ValueError:  # tessera's own (Qwen3-MoE's routing bias): no Hugging Face form
                continue
            out[n] = tuple(b.shape)
    return out


def _open_each(files: dict[str, Path], stack: contextlib.ExitStack) -> dict[Path, Any]:
    """One memory-mapped safe_open handle per shard file (not one per tensor), closed with `stack`."""
    return {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in set(files.values())}


def weight_files(directory: str | os.PathLike, flag: str | None = None) -> dict[str, Path]:
    """HF parameter name -> the safetensors file that holds it (sharded with an index, or one file).
    `flag`: the parameter that named the directory, to begin the messages with (as read_hf_config's)."""
    d = Path(directory)
    named = _named(flag, d) if flag else str(d)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            mapping = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
            if not isinstance(mapping, dict) or not all(isinstance(f, str) for f in mapping.values()):
                raise TypeError("its weight_map is not an object of file names")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e})") from None
        absent = sorted({f for f in mapping.values() if not (d / f).is_file()})
        if absent:
            raise ValueError(f"{index} names {absent[0]}, which is not in {named} (an incomplete download?)")
        return {name: d / file for name, file in mapping.items()}
    single = d / "model.safetensors"
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:  # safetensors' own SafetensorError for a damaged header
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{single}: not a safetensors file ({why})") from None
    raise ValueError(
        f"{named}: no model.safetensors or model.safetensors.index.json (pytorch_model.bin pickles are "
        f"not read: they can run code)"
    )


def _weight_map(
    files: dict[str, Path], cfg: Any, shapes: dict[str, tuple[int, ...]], groups: dict[str, tuple[str, ...]]
) -> dict[str, Source]:
    """tessera owner name -> its Source for every parameter of `cfg` the files hold (a stacked one: the
    indices they hold). A tied parameter stored under either of its names is found; under both, the owner's
    copy is read. HF tensors that are not parameters (rotary buffers) or that the config does not imply
    (layers past n_layers, experts past n_experts) are skipped; a name the family does not know is a ValueError."""
    adapter = _adapter(cfg)
    found: dict[tuple[str, int | None], tuple[int, str, Path]] = {}
    for hf_name, file in files.items():
        ours = adapter.from_hf(hf_name)
        ours, index = ours if isinstance(ours, tuple) else (ours, None)
        if ours is None or ours not in groups:
            continue
        group = groups[ours]
        if index is not None and index >= shapes[group[0]][0]:
            continue
        rank = group.index(ours)
        key = (group[0], index)
        if key not in found or rank < found[key][0]:
            found[key] = (rank, hf_name, file)
    where: dict[str, Source] = {}
    for (owner, index), (_, hf_name, file) in found.items():
        if index is None:
            where[owner] = (hf_name, file)
        else:
            slices = where.setdefault(owner, {})
            if not isinstance(slices, dict):  # from_hf names a parameter either whole or by index, never both
                raise ValueError(f"{owner}: {slices[0]} holds it whole and {hf_name} one slice of it")
            slices[index] = (hf_name, file)
    return where


def hf_weight_map(directory: str | os.PathLike, cfg: Any, flag: str | None = None) -> dict[str, Source]:
    """tessera parameter name (a tied parameter's owner name) -> (HF name, safetensors file), or for a stacked
    parameter index -> (HF name, file), for the Hugging Face directory's weights of the model `cfg`
    describes (`flag`: as weight_files). `read_hf_parameter` reads an entry."""
    shapes, groups = _parameters(cfg)
    return _weight_map(weight_files(directory, flag), cfg, shapes, groups)


def _read(handles: dict[Path, Any], src: Source, block: tuple[slice, ...] | None) -> torch.Tensor:
    """`block` (None: all) of a parameter from the memory-mapped files. A stacked parameter: the indices of
    the block's dim 0 only (this rank's experts), each read as its block of the other dims, then stacked."""
    if not isinstance(src, dict):
        hf_name, file = src
        return handles[file].get_tensor(hf_name) if block is None else handles[file].get_slice(hf_name)[block]
    if block is None:
        return torch.stack([_read(handles, src[i], None) for i in sorted(src)])
    parts = [_read(handles, src[i], block[1:]) for i in range(block[0].start, block[0].stop)]
    if not parts:  # a rank that holds none of the indices
        return torch.empty(0, *(s.stop - s.start for s in block[1:]))
    return torch.stack(parts)


def read_hf_parameter(src: Source) -> torch.Tensor:
    """One parameter, whole, from an hf_weight_map entry (a stacked one's tensors stacked along dim 0)."""
    with contextlib.ExitStack() as stack:
        return _read(_open_each({h: f for h, f in _slices(src).values()}, stack), src, None)


def check_hf_weights(directory: str | os.PathLike, cfg: Any, flag: str | None = None) -> None:
    """Every parameter of `cfg`'s model is in the files with its shape; ValueError naming the file and the tensor
    (`flag`: the parameter that named the directory, to begin the messages with, as read_hf_config's)."""
    files = weight_files(directory, flag)
    want, groups = _parameters(cfg)
    ours = _weight_map(files, cfg, want, groups)
    missing = [hf for n, shape in want.items() for hf in _lacks(n, shape, ours.get(n), cfg)]
    if missing:
        raise ValueError(
            f"{_named(flag, directory) if flag else directory}: the checkpoint lacks "
            f"{missing[0]} (and {len(missing) - 1} more)"
        )
    with contextlib.ExitStack() as stack:
        handles = _open_each(files, stack)
        for name, src in ours.items():
            for index, (hf_name, file) in _slices(src).items():
                expected = want[name] if index is None else want[name][1:]  # a stacked one's: each slice's
                shape = tuple(handles[file].get_slice(hf_name).get_shape())
                if shape != expected:
                    raise ValueError(f"{file}: {hf_name} has shape {list(shape)}, config.json implies {list(expected)}")


# ----------------------------------------------------------------------------- weights in and out
@torch.no_grad()
def load_hf_weights(part: nn.Module, directory: str | os.PathLike, config: Any | None = None) -> None:
    """Fill a (parallelized, materialized) model or pipeline stage with the HF checkpoint's weights.
    `config`: the family's config (default: `part.config`). A parameter sharded in blocks (tp, or FSDP
    alone, or a stack of experts under expert parallel) is read as just this rank's block of the
    memory-mapped files; one sharded in strides (FSDP over tp) is read whole, one parameter at a time, and
    cut locally. A tied parameter is read once, under whichever of its names the part calls it."""
    cfg = config if config is not None else part.config
    files = weight_files(directory)
    shapes, groups = _parameters(cfg)
    where = _weight_map(files, cfg, shapes, groups)
    with contextlib.ExitStack() as stack:
        handles = _open_each(files, stack)
        buffers = ((n, b) for n, b in part.named_buffers() if one_process_name(n) in shapes)
        for name, p in itertools.chain(part.named_parameters(), buffers):
            name = one_process_name(name)
            owner = groups.get(name, (name,))[0]
            missing = _lacks(name, tuple(p.shape), where.get(owner), cfg)  # p.shape: a DTensor's global shape
            if missing:
                raise ValueError(f"{directory}: the checkpoint lacks {missing[0]}")
            src = where[owner]
            if isinstance(p, DTensor) and all(type(pl) in (Shard, Replicate) for pl in p.placements):
                # a block of the global tensor: read just that block from the memory-mapped files
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                block = _read(handles, src, tuple(slice(o, o + n) for o, n in zip(offset, shape)))
                p.to_local().copy_(block.to(p.dtype))
            elif isinstance(p, DTensor):  # strided shards (FSDP over tp): the whole parameter, then this rank's part
                full = _read(handles, src, None).to(p.dtype)
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(_read(handles, src, None).to(p.dtype))


def save_hf(state: dict[str, torch.Tensor], cfg: Any, directory: str | os.PathLike) -> None:
    """Write a Hugging Face directory (config.json, model.safetensors) of `cfg`'s family from a full
    tessera state dict. A tied parameter is written once, under its owner's HF name (transformers re-ties
    the other from config.json's tie_word_embeddings); a stacked one as one tensor per index. The model's
    buffers are written only where the family's checkpoints hold them (DeepSeek-V3's routing bias); other
    buffers (Qwen3-MoE's routing bias) are not, and the family's config_dict refuses a config whose buffers
    would change the outputs."""
    want, groups = _parameters(cfg)
    buffers: set[str] | None = None
    by_owner: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        name = one_process_name(name)
        if name not in groups:
            if buffers is None:  # built only for a state dict that holds more than parameters
                buffers = {n for n, _ in _spec(cfg).build_model(cfg, device="meta").named_buffers()}
            if name in buffers:
                continue
            tessera_to_hf_name(name, cfg)  # a name the family does not know: its ValueError
            raise ValueError(f"{name} is not a parameter of the {_spec(cfg).name} model config.json describes")
        owner = groups[name][0]
        if owner in by_owner and not torch.equal(by_owner[owner], t):  # one tensor in the model: must be one here
            raise ValueError(
                f"{name} and {owner} are one tied parameter of the {_spec(cfg).name} model, but the state "
                f"dict holds different values under the two names (the tie was broken in training)"
            )
        if owner not in by_owner or name == owner:
            by_owner[owner] = t
    missing = [n for n in want if n not in by_owner]
    if missing:
        raise ValueError(f"the state dict lacks {missing[0]} (and {len(missing) - 1} more)")
    tensors: dict[str, torch.Tensor] = {}
    for n, shape in want.items():
        t = by_owner[n]
        if tuple(t.shape) != shape:
            raise ValueError(f"{n} has shape {list(t.shape)} in the state dict; the config implies {list(shape)}")
        for i, hf_name in _hf_names(n, shape, cfg).items():
            # a slice is a view of the stack: cloned, as safetensors refuses tensors that share memory
            tensors[hf_name] = t.contiguous() if i is None else t[i].clone(memory_format=torch.contiguous_format)
    dtype = str(next(iter(tensors.values())).dtype).replace("torch.", "")
    config = hf_config_dict(cfg, dtype)  # first: a config with no HF form leaves no half-written directory
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, d / "model.safetensors", {"format": "pt"})
    (d / "config.json").write_text(json.dumps(config, indent=1))

"""Hugging Face checkpoints in and out for any registered family with an `HFAdapter` (models/spec.py):
config.json <-> the family's config, HF parameter names <-> the family's, safetensors weights in and out.

config.json's model_type picks the family (`spec.spec_for_hf`); the family's adapter reads the rest and
refuses, by field name, what its modules cannot represent. Everything else here goes through the spec:
parameter names through `to_hf`/`from_hf`, shapes from the model built on the meta device. Tied weights
(one nn.Parameter under two names, e.g. a head tied to the token embedding) are found by identity on that
meta build: tessera's name is the owner's (`named_parameters()`'s first), a checkpoint may hold the
parameter under either name, and an export writes it once, under the owner's name, as transformers
does (a tied checkpoint has no lm_head.weight). A rank reads only its own block of each parameter from the
memory-mapped safetensors files (a parameter sharded in strides, FSDP over tp, is read whole, one at a
time); no process ever holds the full state dict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.topology.shapes import ModelShape

from .init import one_process_name
from .spec import HFAdapter, ModelSpec, all_presets, families, get_spec, spec_for_hf, spec_of


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


def hf_to_tessera_name(name: str, model: Any) -> str | None:
    """A Hugging Face parameter name -> the family's (None: not a parameter, e.g. rotary buffers). `model`:
    the family's config, spec or model. ValueError for a name the family does not know."""
    return _adapter(model).from_hf(name)


def tessera_to_hf_name(name: str, model: Any) -> str:
    """The family's parameter name -> Hugging Face's. `model`: the family's config, spec or model."""
    return _adapter(model).to_hf(name)


# ----------------------------------------------------------------------------- config.json
def read_hf_config(directory: str | os.PathLike, flag: str = "--init-from-hf") -> Any:
    """The family's config from a Hugging Face config.json, the family chosen by its model_type;
    ValueError naming the file and the field for what the family cannot represent. `flag`: the option that
    named the directory, for the messages (`tessera convert` passes --from-hf)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        if not str(directory) or not Path(directory).exists():
            raise ValueError(f"{flag} {str(directory) or repr('')}: no such directory; name a Hugging Face model directory "
                             f"(config.json, model.safetensors)")
        if not Path(directory).is_dir():
            raise ValueError(f"{flag} {directory} is a file; name a Hugging Face model directory (config.json, "
                             f"model.safetensors)")
        raise ValueError(f"{flag} {directory}: no config.json in it (a Hugging Face model directory)")
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
        raise ValueError(f"{path}: architecture {arch!r} (model_type {model_type!r}) is not supported; tessera loads "
                         + ", ".join(f"{a} (model_type {t!r})" for t, a in known.items()))
    try:
        return spec_for_hf(model_type, str(path)).hf.read_config(c, str(path))
    except KeyError as e:  # the family's reader indexes the fields it needs
        raise ValueError(f"{path}: no {e.args[0]!r} field (the {model_type} config needs it); {flag} takes a "
                         f"complete Hugging Face config.json") from None
    except (TypeError, AttributeError, ZeroDivisionError) as e:
        raise ValueError(f"{path}: a field holds a value of the wrong kind ({e}); {flag} takes a Hugging Face "
                         f"config.json as transformers writes it") from None


def hf_config_dict(cfg: Any, dtype: str = "float32") -> dict[str, Any]:
    """The config.json contents of a family's config (`dtype` names the weights' dtype)."""
    return _adapter(cfg).config_dict(cfg, dtype)


def compare_with_preset(hf: Any, preset: Any, preset_name: str) -> None:
    """ValueError unless a --model preset has the sizes (and family) of the config read from config.json."""
    a, b = _spec(hf).shape(hf), _spec(preset).shape(preset)
    differ = [f"{f.name} {getattr(a, f.name)} vs {getattr(b, f.name)}" for f in dataclasses.fields(ModelShape)
              if getattr(a, f.name) != getattr(b, f.name)]
    if differ:
        raise ValueError(f"--model {preset_name} does not match the Hugging Face config.json ({'; '.join(differ)}); "
                         f"drop --model: the config is read from config.json")


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
            required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
            if set(saved) <= {f.name for f in fields} and required <= set(saved):
                fits.append(spec.name)
        if len(fits) != 1:
            raise ValueError(f"the checkpoint's model {preset!r} (fields {sorted(saved)}) is not one registered family's "
                             f"config (matching: {fits or 'none'})")
        family = fits[0]
    return get_spec(family).config_type(**saved)


# ----------------------------------------------------------------------------- names and shapes
def _parameters(cfg: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[str, ...]]]:
    """The model of `cfg` built on meta: (owner name -> shape, every name -> the names of its parameter,
    the owner first). A tied parameter has two names; the owner is `named_parameters()`'s."""
    model = _spec(cfg).build_model(cfg, device="meta")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    groups: dict[str, tuple[str, ...]] = {}
    for names in by_id.values():
        owner = next(n for n in names if n in shapes)
        group = (owner, *[n for n in names if n != owner])
        groups.update({n: group for n in names})
    return shapes, groups


def _open_each(files: dict[str, Path], stack: contextlib.ExitStack) -> dict[Path, Any]:
    """One memory-mapped safe_open handle per shard file (not one per tensor), closed with `stack`."""
    from safetensors import safe_open

    return {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in set(files.values())}


def weight_files(directory: str | os.PathLike, flag: str | None = None) -> dict[str, Path]:
    """HF parameter name -> the safetensors file that holds it (sharded with an index, or one file).
    `flag`: the option that named the directory, to begin the messages with."""
    d = Path(directory)
    named = f"{flag} {d}" if flag else str(d)
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
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:  # safetensors' own SafetensorError for a damaged header
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{single}: not a safetensors file ({why})") from None
    raise ValueError(f"{named}: no model.safetensors or model.safetensors.index.json (pytorch_model.bin pickles are "
                     f"not read: they can run code)")


def _weight_map(files: dict[str, Path], cfg: Any, groups: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, Path]]:
    """tessera owner name -> (HF name, file) for every parameter of `cfg` the files hold. A tied parameter
    stored under either of its names is found; under both, the owner's copy is read. HF tensors that are
    not parameters (rotary buffers) or that the config does not imply (layers past n_layers) are skipped;
    a name the family does not know is a ValueError."""
    adapter = _adapter(cfg)
    found: dict[str, tuple[int, str, Path]] = {}
    for hf_name, file in files.items():
        ours = adapter.from_hf(hf_name)
        if ours is None or ours not in groups:
            continue
        group = groups[ours]
        rank = group.index(ours)
        if group[0] not in found or rank < found[group[0]][0]:
            found[group[0]] = (rank, hf_name, file)
    return {owner: (hf_name, file) for owner, (_, hf_name, file) in found.items()}


def hf_weight_map(directory: str | os.PathLike, cfg: Any, flag: str | None = None) -> dict[str, tuple[str, Path]]:
    """tessera parameter name (a tied parameter's owner name) -> (HF name, safetensors file) for the
    Hugging Face directory's weights of the model `cfg` describes (`flag`: as weight_files)."""
    _, groups = _parameters(cfg)
    return _weight_map(weight_files(directory, flag), cfg, groups)


def check_hf_weights(directory: str | os.PathLike, cfg: Any, flag: str | None = None) -> None:
    """Every parameter of `cfg`'s model is in the files with its shape; ValueError naming the file and the tensor
    (`flag`: the option that named the directory, to begin the messages with)."""
    files = weight_files(directory, flag)
    want, groups = _parameters(cfg)
    ours = _weight_map(files, cfg, groups)
    missing = [n for n in want if n not in ours]
    if missing:
        raise ValueError(f"{f'{flag} ' if flag else ''}{directory}: the checkpoint lacks "
                         f"{tessera_to_hf_name(missing[0], cfg)} (and {len(missing) - 1} more)")
    with contextlib.ExitStack() as stack:
        handles = _open_each(files, stack)
        for name, (hf_name, file) in ours.items():
            shape = tuple(handles[file].get_slice(hf_name).get_shape())
            if shape != want[name]:
                raise ValueError(f"{file}: {hf_name} has shape {list(shape)}, config.json implies {list(want[name])}")


# ----------------------------------------------------------------------------- weights in and out
@torch.no_grad()
def load_hf_weights(part: nn.Module, directory: str | os.PathLike, config: Any | None = None) -> None:
    """Fill a (parallelized, materialized) model or pipeline stage with the HF checkpoint's weights.
    `config`: the family's config (default: `part.config`). A parameter sharded in blocks (tp, or FSDP
    alone) is read as just this rank's block of the memory-mapped file; one sharded in strides (FSDP over
    tp) is read whole, one parameter at a time, and cut locally. A tied parameter is read once, under
    whichever of its names the part calls it."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    cfg = config if config is not None else part.config
    files = weight_files(directory)
    _, groups = _parameters(cfg)
    where = _weight_map(files, cfg, groups)
    with contextlib.ExitStack() as stack:
        handles = _open_each(files, stack)
        for name, p in part.named_parameters():
            name = one_process_name(name)
            owner = groups.get(name, (name,))[0]
            if owner not in where:
                raise ValueError(f"{directory}: the checkpoint lacks {tessera_to_hf_name(name, cfg)}")
            hf_name, file = where[owner]
            f = handles[file]
            if isinstance(p, DTensor) and all(type(pl) in (Shard, Replicate) for pl in p.placements):
                # a block of the global tensor: read just that block from the memory-mapped file
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                block = f.get_slice(hf_name)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
                p.to_local().copy_(block.to(p.dtype))
            elif isinstance(p, DTensor):  # strided shards (FSDP over tp): the whole parameter, then this rank's part
                full = f.get_tensor(hf_name).to(p.dtype)
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(f.get_tensor(hf_name).to(p.dtype))


def save_hf(state: dict[str, torch.Tensor], cfg: Any, directory: str | os.PathLike) -> None:
    """Write a Hugging Face directory (config.json, model.safetensors) of `cfg`'s family from a full
    tessera state dict. A tied parameter is written once, under its owner's HF name (transformers re-ties
    the other from config.json's tie_word_embeddings)."""
    from .safetensors_io import write_safetensors

    want, groups = _parameters(cfg)
    by_owner: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        name = one_process_name(name)
        if name not in groups:
            tessera_to_hf_name(name, cfg)  # a name the family does not know: its ValueError
            raise ValueError(f"{name} is not a parameter of the {_spec(cfg).name} model config.json describes")
        owner = groups[name][0]
        if owner in by_owner and not torch.equal(by_owner[owner], t):  # one tensor in the model: must be one here
            raise ValueError(f"{name} and {owner} are one tied parameter of the {_spec(cfg).name} model, but the state "
                             f"dict holds different values under the two names (the tie was broken in training)")
        if owner not in by_owner or name == owner:
            by_owner[owner] = t
    missing = [n for n in want if n not in by_owner]
    if missing:
        raise ValueError(f"the state dict lacks {missing[0]} (and {len(missing) - 1} more)")
    tensors = {tessera_to_hf_name(n, cfg): by_owner[n].contiguous() for n in want}
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    dtype = str(next(iter(tensors.values())).dtype).replace("torch.", "")
    write_safetensors(tensors, d / "model.safetensors", {"format": "pt"})
    (d / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=1))

"""Reading checkpoints: weights (safetensors, sharded, .bin/.pth with weights_only) and config.json."""

from __future__ import annotations

import json
import os
import pickle
import re
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from .errors import ConversionError, list_names
from .lazy import LazyTensors, read_safetensors, read_torch_files

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_FILE = "pytorch_model.bin"
PYTORCH_INDEX = "pytorch_model.bin.index.json"


def open_checkpoint(src: str | os.PathLike) -> LazyTensors:
    """The tensors of a checkpoint folder (or a single weights file), read lazily (lazy.py): names, shapes and
    dtypes now, each tensor's bytes when it is asked for.

    Folder lookup order: model.safetensors, model.safetensors.index.json, pytorch_model.bin,
    pytorch_model.bin.index.json. Pickle files are read only with `torch.load(weights_only=True)`.
    """
    path = _weights_file(Path(src))
    name = path.name
    if name.endswith(".index.json"):
        return _open_sharded(path)
    if name.endswith(".safetensors"):
        return read_safetensors([path])
    if name.endswith((".bin", ".pt", ".pth")):
        return read_torch_files([path], _mapped_state_dict)
    if name.endswith(".gguf"):
        raise ConversionError(f"{path} is a GGUF file: read it with load_gguf(path, expected_architecture=...)")
    raise ConversionError(
        f"unrecognised weights file {path}: expected a .safetensors, .bin/.pt/.pth or *.index.json file"
    )


def load_checkpoint(src: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (open_checkpoint, read at once): for small checkpoints and tests."""
    state = open_checkpoint(src)
    return {key: state[key] for key in state}


def _weights_file(path: Path) -> Path:
    """The weights file of a checkpoint folder (model.safetensors, model.safetensors.index.json,
    pytorch_model.bin, pytorch_model.bin.index.json, first found), or the file given."""
    if not path.exists():
        raise ConversionError(f"checkpoint path {path} does not exist")
    if not path.is_dir():
        return path
    for name in (SAFETENSORS_FILE, SAFETENSORS_INDEX, PYTORCH_FILE, PYTORCH_INDEX):
        if (path / name).is_file():
            return path / name
    present = list_names(p.name for p in path.iterdir()) or "nothing"
    raise ConversionError(
        f"no weights found in {path}: expected one of {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, "
        f"{PYTORCH_FILE}, {PYTORCH_INDEX}; the folder holds: {present}"
    )


def checkpoint_keys(src: str | os.PathLike) -> list[str]:
    """The tensor names of a checkpoint, without reading a tensor."""
    return list(open_checkpoint(src))


def torch_load_weights_only(path: Path):
    """torch.load with weights_only=True (tensors and plain containers only), errors as ConversionError."""
    return _refusing_code(path, lambda p: torch.load(p, map_location="cpu", weights_only=True))


def _refusing_code(path: Path, load):
    try:
        return load(path)
    except pickle.UnpicklingError as error:
        # weights_only refuses any global that is not a tensor/plain container: never retry without it.
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConversionError(
            f"refusing to load {path}: it holds more than plain tensors and could run code when unpickled "
            f"(torch.load weights_only=True said: {first_line}). Re-save it as safetensors from a trusted source."
        ) from error
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as error:
        raise ConversionError(
            f"{path} is not a readable PyTorch weights file (truncated or corrupt?): {error}"
        ) from error


def torch_load_mapped(path: Path) -> tuple[Mapping, bool]:
    """(torch.load(mmap=True, weights_only=True), True): tensors backed by the file, read when touched; the
    legacy (non-zip) format cannot be mapped: (its tensors in memory, False)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True), True
    except RuntimeError as error:
        if "mmap" not in str(error):
            raise
        return torch.load(path, map_location="cpu", weights_only=True), False


def _mapped_state_dict(path: Path) -> tuple[Mapping, bool]:
    loaded, mapped = _refusing_code(path, torch_load_mapped)
    if not isinstance(loaded, Mapping):
        raise ConversionError(f"{path} holds a {type(loaded).__name__}, expected a dict of tensors (a state dict)")
    not_tensors = [str(k) for k, v in loaded.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise ConversionError(
            f"{path} is not a plain state dict: entries that are not tensors: {list_names(not_tensors)}"
        )
    return loaded, mapped


def _open_sharded(index_path: Path) -> LazyTensors:
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"cannot read shard index {index_path}: {error}") from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConversionError(f"shard index {index_path} has no 'weight_map' object mapping tensor names to shards")
    by_shard: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ConversionError(f"shard index {index_path}: tensor {key!r} points at {shard!r}, not a file name")
        by_shard.setdefault(shard, []).append(key)
    missing = [shard for shard in by_shard if not (index_path.parent / shard).is_file()]
    if missing:
        raise ConversionError(
            f"shard index {index_path} points at missing shard file(s): "
            + ", ".join(f"{index_path.parent / shard} ({len(by_shard[shard])} tensors)" for shard in sorted(missing))
        )
    owners = {}
    for shard, keys in by_shard.items():
        path = index_path.parent / shard
        tensors = read_safetensors([path]) if shard.endswith(".safetensors") else read_torch_files([path], _mapped_state_dict)
        absent = [key for key in keys if key not in tensors]
        if absent:
            raise ConversionError(f"shard {path} lacks tensors that its index assigns to it: {list_names(absent)}")
        owners.update(dict.fromkeys(keys, tensors))
    return LazyTensors.joined(owners)


def load_config_json(src: str | os.PathLike) -> dict:
    """config.json of a checkpoint folder (or the JSON file itself) as a dict."""
    path = Path(src)
    if path.is_dir():
        path = path / "config.json"
    elif path.is_file() and path.suffix != ".json":
        # a weights file given as the source: its config is the config.json beside it
        if not (path.parent / "config.json").is_file():
            raise ConversionError(
                f"{path} is a weights file and its folder {path.parent} holds no config.json; pass the checkpoint "
                "folder (config.json + weights)"
            )
        path = path.parent / "config.json"
    if not path.is_file():
        raise ConversionError(f"no config.json found: {path} does not exist")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise ConversionError(f"cannot read {path}: {error}") from error
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ConversionError(f"{path} holds a JSON {type(config).__name__}, expected an object")
    return config


def require_model_type(config: Mapping, expected: str | Iterable[str], *, src: str | os.PathLike) -> str:
    """Returns config["model_type"] if it is one of `expected`, else raises naming the value found."""
    allowed = [expected] if isinstance(expected, str) else list(expected)
    model_type = config.get("model_type")
    if model_type not in allowed:
        raise ConversionError(
            f"{src} is not a {' / '.join(allowed)} checkpoint: its config.json has model_type={model_type!r}"
        )
    return model_type


def hf_tiny_config_from_dict(raw: Mapping, config_class, *, src):
    """config_class from an hf_tiny folder's config.json dict (model_type checked; auto_map left out)."""
    require_model_type(raw, config_class.model_type, src=src)
    try:
        return config_class.from_dict({k: v for k, v in raw.items() if k != "auto_map"})
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}: invalid {config_class.model_type} config: {error}") from error


def load_hf_tiny_config(src: str | os.PathLike, config_class, *, supported: Iterable[str], default: str):
    """An hf_tiny folder's config (config_class, model_type checked) and its architecture, which must be one of
    `supported` (`default` when config.json names none). The reverse converters start here."""
    config = hf_tiny_config_from_dict(load_config_json(src), config_class, src=src)
    architecture = (config.architectures or [default])[0]
    supported = list(supported)
    if architecture not in supported:
        raise ConversionError(f"{src}: architecture {architecture!r} is not supported; supported: {', '.join(supported)}")
    return config, architecture


def official_config(raw: Mapping, *, src):
    """The transformers config object of a config.json dict (AutoConfig.for_model, which also standardizes
    fields such as rope_parameters); an invalid config is an error naming the source."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    model_type = raw.get("model_type")
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "_model_name_or_path")}
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError, KeyError, StrictDataclassError) as error:  # the last: a value official validates
        raise ConversionError(f"{src}: config.json is not a valid {model_type} config: {error}") from error


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def hub_id_of(path: str | os.PathLike, name_or_path: object = None) -> str | None:
    """The Hub model id a source came from, where it shows: a Hugging Face cache snapshot
    (`.../models--ORG--NAME/snapshots/<commit>/...`), else a config's `_name_or_path` of the form `org/name` that is
    no local path; None when neither says (a local folder's own name is no model id, and the Hub refuses a card whose
    base_model is not one)."""
    for part in reversed(Path(path).resolve().parts):
        if part.startswith("models--") and part.count("--") >= 2:
            return part[len("models--"):].replace("--", "/", 1)
    if isinstance(name_or_path, str) and _HUB_ID.fullmatch(name_or_path) and not os.path.exists(name_or_path):
        return name_or_path
    return None


def source_name(path: str | os.PathLike) -> str:
    """How a card names a source: its Hub id where the path shows one (a cache snapshot's folder is a commit hash),
    else the file or folder name."""
    return hub_id_of(path) or Path(path).resolve().name

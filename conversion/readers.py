"""Reading checkpoints: weights (safetensors, sharded, .bin/.pth with weights_only) and config.json."""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from .errors import ConversionError, list_names

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_FILE = "pytorch_model.bin"
PYTORCH_INDEX = "pytorch_model.bin.index.json"


def load_checkpoint(src: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Reads every tensor of a checkpoint folder (or a single weights file) onto the CPU.

    Folder lookup order: model.safetensors, model.safetensors.index.json, pytorch_model.bin,
    pytorch_model.bin.index.json. Pickle files are read only with `torch.load(weights_only=True)`.
    """
    path = _weights_file(Path(src))
    name = path.name
    if name.endswith(".index.json"):
        return _load_sharded(path)
    if name.endswith(".safetensors"):
        return _load_safetensors(path)
    if name.endswith((".bin", ".pt", ".pth")):
        return _load_pickle_weights_only(path)
    if name.endswith(".gguf"):
        raise ConversionError(f"{path} is a GGUF file: read it with load_gguf(path, expected_architecture=...)")
    raise ConversionError(
        f"unrecognised weights file {path}: expected a .safetensors, .bin/.pt/.pth or *.index.json file"
    )


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
    """The tensor names of the weights load_checkpoint would read, from the safetensors header or shard index
    where there is one (pickle files are loaded)."""
    path = _weights_file(Path(src))
    if path.name.endswith(".index.json"):
        try:
            return list(json.loads(path.read_text()).get("weight_map", {}))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
            raise ConversionError(f"cannot read shard index {path}: {error}") from error
    if path.name.endswith(".safetensors"):
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                return list(handle.keys())
        except (SafetensorError, OSError) as error:
            raise ConversionError(f"{path} is not a valid safetensors file (truncated or corrupt?): {error}") from error
    return list(load_checkpoint(path))


def _load_safetensors(path: Path, expected_keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            keys = list(handle.keys())
            if expected_keys is not None:
                keys = _keys_from_shard(path, set(keys), expected_keys)
            return {key: handle.get_tensor(key) for key in keys}
    except SafetensorError as error:
        raise ConversionError(f"{path} is not a valid safetensors file (truncated or corrupt?): {error}") from error
    except OSError as error:
        raise ConversionError(f"cannot read {path}: {error}") from error


def torch_load_weights_only(path: Path):
    """torch.load with weights_only=True (tensors and plain containers only), errors as ConversionError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
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


def _load_pickle_weights_only(path: Path, expected_keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    loaded = torch_load_weights_only(path)
    if not isinstance(loaded, Mapping):
        raise ConversionError(f"{path} holds a {type(loaded).__name__}, expected a dict of tensors (a state dict)")
    not_tensors = [str(k) for k, v in loaded.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise ConversionError(
            f"{path} is not a plain state dict: entries that are not tensors: {list_names(not_tensors)}"
        )
    state = dict(loaded)
    if expected_keys is not None:
        state = {key: state[key] for key in _keys_from_shard(path, set(state), expected_keys)}
    return state


def _keys_from_shard(path: Path, present: set[str], expected_keys: Iterable[str]) -> list[str]:
    expected = list(expected_keys)
    missing = [key for key in expected if key not in present]
    if missing:
        raise ConversionError(f"shard {path} lacks tensors that its index assigns to it: {list_names(missing)}")
    return expected


def _load_sharded(index_path: Path) -> dict[str, torch.Tensor]:
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
    state: dict[str, torch.Tensor] = {}
    for shard, keys in by_shard.items():
        shard_path = index_path.parent / shard
        if shard.endswith(".safetensors"):
            state.update(_load_safetensors(shard_path, keys))
        else:
            state.update(_load_pickle_weights_only(shard_path, keys))
    return state


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
    from transformers import AutoConfig

    model_type = raw.get("model_type")
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "_model_name_or_path")}
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError, KeyError) as error:
        raise ConversionError(f"{src}: config.json is not a valid {model_type} config: {error}") from error

"""Shared machinery of every checkpoint converter (`python -m conversion FAMILY SRC DST`).

A family converter (conversion/bert.py, llama.py, ...) is a declarative `KeyMap` plus a few lines of glue:

    state = load_checkpoint(src)                        # safetensors / sharded / .bin (weights_only)
    config = load_config_json(src)
    require_model_type(config, "bert", src=src)
    ours = KEY_MAP.to_target(state, num_layers=config["num_hidden_layers"], progress=True)
    check_shapes(ours, expected_shapes(meta_model))     # meta_model built on the meta device
    with atomic_output_dir(dst, force=force) as tmp:    # dst appears complete or not at all
        save_state_dict_safetensors(ours, tmp / "model.safetensors")
        copy_tokenizer_files(src, tmp)
        write_model_card(tmp, ...)

Public API
----------
ConversionError                         the user-facing error; the CLI prints its message as one line.
load_checkpoint(src)                    folder or file -> {name: tensor}. model.safetensors, sharded safetensors
                                        (model.safetensors.index.json), pytorch_model.bin(.index.json) loaded
                                        only with torch.load(weights_only=True).
load_config_json(src)                   config.json of a folder (or the file itself) -> dict.
load_gguf(path, *, expected_architecture, dtype=None)
                                        -> (config dict, state dict with transformers names, dequantized).
require_model_type(config, expected, *, src)
                                        config["model_type"] must be one of `expected`.
load_hf_tiny_config(src, config_class, *, supported, default)
                                        an hf_tiny folder -> (config, architecture), both checked.
KeyMap(rules, *, ignore=(), ignore_target=())
    .to_target(sd, *, num_layers, progress=False)  source naming -> hf_tiny naming (strict)
    .to_source(sd, *, num_layers, progress=False)  the exact inverse (bit-exact round trip)
    .source_keys(num_layers) / .target_keys(num_layers)
Rule(source, target, transform=None, optional=False)   one rule; KeyMap also accepts plain tuples.
Transform(name, forward, backward)      a named pair of inverse functions applied by a rule.
check_shapes(state_dict, expected)      missing / unexpected / wrong-shape keys -> one ConversionError.
expected_shapes(module)                 {name: shape} of a module's state dict (build it on the meta device).
cast_floating(state_dict, dtype)        casts floating tensors only (ids/int buffers untouched).
parse_dtype(name)                       "float32" | "bfloat16" | "float16" (| torch.dtype) -> torch.dtype.
max_abs_diff(a, b)                      float max |a - b| (computed in float64).
parity_plans(dtype) / parity_row(...) / fail_on_parity(rows, what)
                                        the (device, dtype, backend) runs, a model-card row, the fp32 verdict.
save_state_dict_safetensors(sd, path, *, metadata=None)
                                        saves tensors that share memory (tied weights) as separate copies.
atomic_output_dir(dst, *, force=False, src=None)
                                        context manager yielding a temp folder beside dst, swapped in on success;
                                        src (optional) refuses a dst that is or contains the source.
copy_tokenizer_files(src_dir, dst_dir)  copies the tokenizer files (and generation_config.json) that exist.
write_official_folder(tmp, official_class, official_config, state, src)
                                        a reverse conversion's output: config, checked tensors, tokenizer.
render_model_card(template_name="hf_tiny", **fields) / write_model_card(dst_dir, template_name=..., **fields)
                                        model_cards/<name>.md filled in; writes dst_dir/README.md.
TOKENIZER_FILES, MODEL_CARDS_DIR        the file names copied, and where the templates live.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import pickle
import re
import shutil
import string
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "ConversionError",
    "KeyMap",
    "Rule",
    "Transform",
    "TOKENIZER_FILES",
    "atomic_output_dir",
    "cast_floating",
    "check_shapes",
    "copy_tokenizer_files",
    "expected_shapes",
    "load_checkpoint",
    "load_config_json",
    "load_gguf",
    "max_abs_diff",
    "parse_dtype",
    "render_model_card",
    "require_model_type",
    "save_state_dict_safetensors",
    "write_model_card",
]


class ConversionError(Exception):
    """A conversion failed for a reason the user can act on; the message says which and where."""


# How many names an error message lists before it summarises the rest.
_MAX_LISTED = 40


def _list_names(names: Iterable[str], limit: int = _MAX_LISTED) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return shown


# ----------------------------------------------------------------------------------------------------------------
# Reading checkpoints
# ----------------------------------------------------------------------------------------------------------------

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_FILE = "pytorch_model.bin"
PYTORCH_INDEX = "pytorch_model.bin.index.json"


def load_checkpoint(src: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Reads every tensor of a checkpoint folder (or a single weights file) onto the CPU.

    Folder lookup order: model.safetensors, model.safetensors.index.json, pytorch_model.bin,
    pytorch_model.bin.index.json. Pickle files are read only with `torch.load(weights_only=True)`.
    """
    path = Path(src)
    if not path.exists():
        raise ConversionError(f"checkpoint path {path} does not exist")
    if path.is_dir():
        for name in (SAFETENSORS_FILE, SAFETENSORS_INDEX, PYTORCH_FILE, PYTORCH_INDEX):
            if (path / name).is_file():
                return load_checkpoint(path / name)
        present = _list_names(p.name for p in path.iterdir()) or "nothing"
        raise ConversionError(
            f"no weights found in {path}: expected one of {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, "
            f"{PYTORCH_FILE}, {PYTORCH_INDEX}; the folder holds: {present}"
        )
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


def _load_pickle_weights_only(path: Path, expected_keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
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
    if not isinstance(loaded, Mapping):
        raise ConversionError(f"{path} holds a {type(loaded).__name__}, expected a dict of tensors (a state dict)")
    not_tensors = [str(k) for k, v in loaded.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise ConversionError(
            f"{path} is not a plain state dict: entries that are not tensors: {_list_names(not_tensors)}"
        )
    state = dict(loaded)
    if expected_keys is not None:
        state = {key: state[key] for key in _keys_from_shard(path, set(state), expected_keys)}
    return state


def _keys_from_shard(path: Path, present: set[str], expected_keys: Iterable[str]) -> list[str]:
    expected = list(expected_keys)
    missing = [key for key in expected if key not in present]
    if missing:
        raise ConversionError(f"shard {path} lacks tensors that its index assigns to it: {_list_names(missing)}")
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


def load_hf_tiny_config(src: str | os.PathLike, config_class, *, supported: Iterable[str], default: str):
    """An hf_tiny folder's config (config_class, model_type checked) and its architecture, which must be one of
    `supported` (`default` when config.json names none). The reverse converters start here."""
    raw = load_config_json(src)
    require_model_type(raw, config_class.model_type, src=src)
    try:
        config = config_class.from_dict({k: v for k, v in raw.items() if k != "auto_map"})
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}: invalid {config_class.model_type} config: {error}") from error
    architecture = (config.architectures or [default])[0]
    supported = list(supported)
    if architecture not in supported:
        raise ConversionError(f"{src}: architecture {architecture!r} is not supported; supported: {', '.join(supported)}")
    return config, architecture


# ----------------------------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------------------------


def _gguf_dequantizable_types() -> set:
    """GGML tensor types that gguf-py (used by transformers) can dequantize."""
    from gguf import GGMLQuantizationType

    supported = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
    try:
        from gguf.quants import _type_traits  # private, but the exact list `gguf.dequantize` consults

        supported |= set(_type_traits)
    except ImportError:  # older/newer gguf-py: fall back to the types every version since 0.10 handles
        supported |= {
            getattr(GGMLQuantizationType, name)
            for name in ("BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
            if hasattr(GGMLQuantizationType, name)
        }
    return supported


def _official_meta_model(config: dict):
    """The official transformers model of a GGUF config, on the meta device (names only, no memory)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    if config["model_type"] in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        auto = AutoModelForCausalLM
    elif config["model_type"] in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        auto = AutoModelForSeq2SeqLM
    else:
        auto = AutoModel
    with torch.device("meta"):
        return auto.from_config(hf_config)


@contextlib.contextmanager
def _gguf_shared_parsing(path: Path, reader):
    """Lets transformers' GGUF loader reuse our parsed reader and one tensor-name map.

    load_gguf_checkpoint builds a fresh GGUFReader per call (~4 s for a 100 MB file with its tokenizer) and
    get_gguf_hf_weights_map rebuilds gguf's TensorNameMap for every submodule (hundreds of times). Both are
    looked up as `from gguf import ...` at call time, so swapping the gguf attributes for the duration of
    the load serves them from one parse; the originals are restored afterwards.
    """
    import functools

    import gguf

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reuse_reader(file, *args, **kwargs):
        if not args and not kwargs and Path(file) == path:
            return reader
        return original_reader(file, *args, **kwargs)

    gguf.GGUFReader = reuse_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map


def load_gguf(
    path: str | os.PathLike, *, expected_architecture: str, dtype: torch.dtype | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Reads a GGUF file into (transformers config dict, dequantized state dict with transformers names).

    The architecture and every tensor's quantization type are checked before anything is dequantized, and
    every GGUF tensor must get a transformers name. Tensors come from transformers' own GGUF loader
    (load_gguf_checkpoint), so q/k are un-permuted exactly as in
    `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`.
    """
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"GGUF file {path} does not exist")
    try:
        from gguf import GGUFReader

        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            load_gguf_checkpoint,
            read_field,
        )
    except ImportError as error:
        raise ConversionError(f"reading GGUF needs the `gguf` package (pip install gguf): {error}") from error

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as error:
        raise ConversionError(f"{path} is not a valid GGUF file (truncated or corrupt?): {error}") from error
    found = read_field(reader, "general.architecture")
    if not found:
        raise ConversionError(f"{path} has no general.architecture field; cannot tell which model it holds")
    architecture = str(found[0])
    if architecture != expected_architecture:
        raise ConversionError(
            f"{path} is a GGUF of architecture {architecture!r}, expected {expected_architecture!r}"
        )
    supported = _gguf_dequantizable_types()
    unsupported = [f"{t.name} ({t.tensor_type.name})" for t in reader.tensors if t.tensor_type not in supported]
    if unsupported:
        raise ConversionError(
            f"{path}: cannot dequantize tensor(s) with unsupported quantization type: {_list_names(unsupported)}; "
            f"supported types: {_list_names(t.name for t in supported)}"
        )
    gguf_names = [t.name for t in reader.tensors]

    try:
        with _gguf_shared_parsing(path, reader):
            config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
            model = _official_meta_model(config)
            processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
            name_map = get_gguf_hf_weights_map(model, processor)
            unmapped = [name for name in gguf_names if name not in name_map]
            if unmapped:
                raise ConversionError(
                    f"{path}: GGUF tensors with no transformers name for architecture {architecture!r}: "
                    f"{_list_names(unmapped)}"
                )
            loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=dtype)
    except ConversionError:
        raise
    except (ValueError, KeyError, NotImplementedError, OSError) as error:
        raise ConversionError(f"cannot read GGUF file {path}: {type(error).__name__}: {error}") from error
    return dict(config), dict(loaded["tensors"])


# ----------------------------------------------------------------------------------------------------------------
# Key maps
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transform:
    """A named pair of inverse tensor functions applied by a rule.

    forward(*source_tensors) -> target tensor, or a tuple with one tensor per target key;
    backward(*target_tensors) -> source tensor, or a tuple with one tensor per source key.
    backward(forward(x)) must equal x bit-exactly (the round-trip tests check it).
    """

    name: str
    forward: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    backward: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Rule:
    """Maps source key(s) to target key(s); templates may use placeholders like {i} (a layer index).

    Without a transform, one side may hold several keys: they are tied copies of one tensor (one source ->
    several targets copies it; several sources -> one target requires them bit-equal and keeps one).
    optional=True: the rule is skipped when none of its input keys is present in any layer (e.g. a bias some
    checkpoints lack); present in some layers only, the missing ones are an error.
    """

    source: str | tuple[str, ...]
    target: str | tuple[str, ...]
    transform: Transform | None = None
    optional: bool = False

    def __post_init__(self):
        for side in ("source", "target"):
            value = getattr(self, side)
            keys = (value,) if isinstance(value, str) else tuple(value)
            if not keys or not all(isinstance(k, str) and k for k in keys):
                raise ValueError(f"Rule.{side} must be a non-empty key or tuple of keys, got {value!r}")
            object.__setattr__(self, side, keys)
        if self.transform is not None and not isinstance(self.transform, Transform):
            raise TypeError(f"Rule.transform must be a Transform, got {type(self.transform).__name__}")
        if self.transform is None and len(self.source) > 1 and len(self.target) > 1:
            raise ValueError(f"a rule without transform cannot map several keys to several keys: {self!r}")
        placeholders = _placeholders(self.source + self.target)
        for side in (self.source, self.target):
            for key in side:
                if _placeholders((key,)) != placeholders:
                    raise ValueError(
                        f"every key of a rule must use the same placeholders {sorted(placeholders)}; {key!r} does not"
                    )


_FORMATTER = string.Formatter()


def _placeholders(templates: Iterable[str]) -> set[str]:
    return {field for template in templates for _, field, _, _ in _FORMATTER.parse(template) if field is not None}


def _as_rule(rule) -> Rule:
    if isinstance(rule, Rule):
        return rule
    if isinstance(rule, (tuple, list)) and len(rule) in (2, 3):
        return Rule(*rule)
    raise TypeError(f"a KeyMap rule is a Rule or a (source, target[, transform]) tuple, got {rule!r}")


@dataclass(frozen=True)
class _ConcreteRule:
    source: tuple[str, ...]
    target: tuple[str, ...]
    transform: Transform | None
    optional: bool
    origin: int  # index of the Rule it was expanded from


class KeyMap:
    """A declarative, strict, reversible map between a source checkpoint naming and the hf_tiny naming.

    rules: Rule objects or (source, target[, transform]) tuples. Placeholders ({i}, {j}, ...) range over
    `num_layers` (an int for every placeholder, or a mapping {placeholder: count}).
    ignore: regexes (full match) of source keys that are dropped on purpose (e.g. position_ids buffers).
    ignore_target: regexes of hf_tiny keys dropped on purpose when mapping back.
    """

    def __init__(self, rules: Iterable, *, ignore: Iterable[str] = (), ignore_target: Iterable[str] = ()):
        self.rules: tuple[Rule, ...] = tuple(_as_rule(rule) for rule in rules)
        if not self.rules:
            raise ValueError("a KeyMap needs at least one rule")
        self.ignore = tuple(re.compile(pattern) for pattern in ignore)
        self.ignore_target = tuple(re.compile(pattern) for pattern in ignore_target)
        self.placeholders = _placeholders(k for rule in self.rules for k in rule.source + rule.target)

    def __repr__(self) -> str:
        return f"KeyMap({len(self.rules)} rules, ignore={[p.pattern for p in self.ignore]})"

    def _expand(self, num_layers: int | Mapping[str, int]) -> list[_ConcreteRule]:
        if isinstance(num_layers, Mapping):
            counts = dict(num_layers)
        else:
            counts = {name: num_layers for name in self.placeholders}
        for name in self.placeholders:
            count = counts.get(name)
            if count is None:
                raise ValueError(f"num_layers gives no count for placeholder {{{name}}}: {num_layers!r}")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"num_layers[{name!r}] must be an int >= 0, got {count!r}")
        concrete = []
        for origin, rule in enumerate(self.rules):
            names = sorted(_placeholders(rule.source + rule.target))
            for values in itertools.product(*(range(counts[n]) for n in names)):
                fill = dict(zip(names, values, strict=True))
                concrete.append(
                    _ConcreteRule(
                        tuple(k.format(**fill) for k in rule.source),
                        tuple(k.format(**fill) for k in rule.target),
                        rule.transform,
                        rule.optional,
                        origin,
                    )
                )
        for side in ("source", "target"):
            seen: dict[str, int] = {}
            for rule in concrete:
                for key in getattr(rule, side):
                    seen[key] = seen.get(key, 0) + 1
            duplicated = [k for k, n in seen.items() if n > 1]
            if duplicated:
                raise ValueError(f"KeyMap rules name these {side} keys more than once: {_list_names(duplicated)}")
        return concrete

    def source_keys(self, num_layers: int | Mapping[str, int]) -> list[str]:
        return [key for rule in self._expand(num_layers) for key in rule.source]

    def target_keys(self, num_layers: int | Mapping[str, int]) -> list[str]:
        return [key for rule in self._expand(num_layers) for key in rule.target]

    def to_target(
        self, state_dict: Mapping[str, torch.Tensor], *, num_layers: int | Mapping[str, int], progress: bool = False
    ) -> dict[str, torch.Tensor]:
        """Source naming -> hf_tiny naming; every source tensor is used or ignored, every rule is satisfied."""
        return self._apply(state_dict, num_layers, forward=True, progress=progress)

    def to_source(
        self, state_dict: Mapping[str, torch.Tensor], *, num_layers: int | Mapping[str, int], progress: bool = False
    ) -> dict[str, torch.Tensor]:
        """hf_tiny naming -> source naming; the exact inverse of to_target (minus ignored keys)."""
        return self._apply(state_dict, num_layers, forward=False, progress=progress)

    def _apply(self, state_dict, num_layers, *, forward: bool, progress: bool) -> dict[str, torch.Tensor]:
        from tqdm.auto import tqdm

        rules = self._expand(num_layers)
        ignore = self.ignore if forward else self.ignore_target
        direction = "source" if forward else "hf_tiny"
        missing: list[str] = []
        runnable: list[tuple[tuple[str, ...], tuple[str, ...], Callable | None, Transform | None]] = []
        used: set[str] = set()
        # An optional rule is all-or-nothing over its layers: absent everywhere -> skipped, else required.
        present_origins = {
            rule.origin
            for rule in rules
            if any(key in state_dict for key in (rule.source if forward else rule.target))
        }
        for rule in rules:
            inputs, outputs = (rule.source, rule.target) if forward else (rule.target, rule.source)
            if rule.optional and rule.origin not in present_origins:
                continue
            present = [key for key in inputs if key in state_dict]
            missing.extend(key for key in inputs if key not in state_dict)
            used.update(present)
            function = None
            if rule.transform is not None:
                function = rule.transform.forward if forward else rule.transform.backward
            runnable.append((inputs, outputs, function, rule.transform))
        unknown = [k for k in state_dict if k not in used and not any(p.fullmatch(k) for p in ignore)]
        problems = []
        if missing:
            problems.append(f"missing {direction} tensors: {_list_names(missing)}")
        if unknown:
            problems.append(f"unexpected {direction} tensors (not mapped, not ignored): {_list_names(unknown)}")
        if problems:
            raise ConversionError("; ".join(problems))

        result: dict[str, torch.Tensor] = {}
        bar = tqdm(runnable, desc="mapping tensors", unit="rule", disable=not progress, file=sys.stderr, leave=False)
        for inputs, outputs, function, transform in bar:
            tensors = [state_dict[key] for key in inputs]
            if function is None:
                _require_tied(inputs, tensors)
                produced = (tensors[0],) * len(outputs)
            else:
                try:
                    produced = function(*tensors)
                except Exception as error:  # a transform failing on a bad tensor is the user's checkpoint
                    raise ConversionError(
                        f"transform {transform.name!r} failed on {', '.join(inputs)}: {type(error).__name__}: {error}"
                    ) from error
                produced = (produced,) if isinstance(produced, torch.Tensor) else tuple(produced)
                if len(produced) != len(outputs):
                    raise ConversionError(
                        f"transform {transform.name!r} returned {len(produced)} tensors for {len(outputs)} keys "
                        f"{', '.join(outputs)}"
                    )
            result.update(zip(outputs, produced, strict=True))
        return result


def _require_tied(keys: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    first = tensors[0]
    for key, tensor in zip(keys[1:], tensors[1:], strict=True):
        if tensor.shape != first.shape or tensor.dtype != first.dtype or not torch.equal(tensor, first):
            raise ConversionError(
                f"tensors {keys[0]} and {key} should be tied (identical) copies but differ"
            )


def check_shapes(state_dict: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size]) -> None:
    """Raises one ConversionError naming every missing, unexpected and wrong-shape key."""
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    wrong = [
        f"{k} (expected {tuple(expected[k])}, got {tuple(state_dict[k].shape)})"
        for k in expected
        if k in state_dict and tuple(state_dict[k].shape) != tuple(expected[k])
    ]
    # hf_tiny models hold floating tensors only: an integer or bool weight is a corrupt or foreign checkpoint
    not_floating = [
        f"{k} ({str(state_dict[k].dtype).removeprefix('torch.')})"
        for k in expected
        if k in state_dict and not state_dict[k].is_floating_point()
    ]
    problems = []
    if not_floating:
        problems.append(f"tensors that must hold floating-point weights: {_list_names(sorted(not_floating))}")
    if wrong:
        problems.append(f"wrong shapes: {', '.join(sorted(wrong))}")
    if missing:
        problems.append(f"missing tensors: {_list_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_list_names(unexpected)}")
    if problems:
        raise ConversionError("; ".join(problems))


def expected_shapes(module: torch.nn.Module) -> dict[str, torch.Size]:
    """{name: shape} of a module's state dict; build the module on the meta device to make this free."""
    return {name: tensor.shape for name, tensor in module.state_dict().items()}


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """'float32' | 'bfloat16' | 'float16' (or a torch.dtype, or None) -> torch.dtype (or None)."""
    if name is None or isinstance(name, torch.dtype):
        if isinstance(name, torch.dtype) and name not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {name}")
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def cast_floating(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Casts floating-point tensors to dtype (None: unchanged); integer/bool tensors keep their dtype.

    A cast that turns finite values into inf (|value| above the dtype's largest number, e.g. 65504 in float16) is
    an error naming the dtype and the first such tensor: such a model would compute NaN."""
    if dtype is None:
        return dict(state_dict)
    cast = {}
    for key, value in state_dict.items():
        if not value.is_floating_point():
            cast[key] = value
            continue
        cast[key] = value.to(dtype)
        if dtype.itemsize < value.dtype.itemsize or torch.finfo(dtype).max < torch.finfo(value.dtype).max:
            overflow = torch.isinf(cast[key]) & torch.isfinite(value)
            if bool(overflow.any()):
                largest = float(value[overflow].abs().max())
                raise ConversionError(
                    f"--dtype {str(dtype).removeprefix('torch.')}: tensor {key} holds {largest:.6g}, beyond the largest "
                    f"{str(dtype).removeprefix('torch.')} number ({torch.finfo(dtype).max:.6g}); the cast would make it "
                    "inf. Convert to float32 or bfloat16 instead"
                )
    return cast


def first_non_finite(state_dict: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor holding NaN or inf, or None."""
    for key, value in state_dict.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return key
    return None


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| as a Python float, computed in float64 on the CPU (NaN if either side has a NaN)."""
    if a.shape != b.shape:
        raise ValueError(f"max_abs_diff needs equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    diff = (a.detach().to("cpu", torch.float64) - b.detach().to("cpu", torch.float64)).abs()
    if torch.isnan(diff).any():
        return math.nan
    return float(diff.max())


# Parity measured at conversion time: tolerance = RELATIVE_TOLERANCE[dtype] * max(1, max |official output|).
RELATIVE_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def parity_plans(dtype: torch.dtype) -> list[tuple[str, torch.dtype, str]]:
    """(device, dtype, backend) runs to measure: CPU eager/sdpa in `dtype`; with CUDA also fp32 eager/sdpa and
    bf16 eager/sdpa/flash."""
    plans = [("cpu", dtype, backend) for backend in ("eager", "sdpa")]
    if torch.cuda.is_available():
        plans += [("cuda", torch.float32, b) for b in ("eager", "sdpa")]
        plans += [("cuda", torch.bfloat16, b) for b in ("eager", "sdpa", "flash_attention_2")]
    return plans


def parity_row(backend: str, dtype: torch.dtype, device: str, diff: float, scale: float) -> dict:
    """One model-card parity row; scale is max(1, max |official output|)."""
    return {
        "backend": backend,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "max_abs_diff": diff,
        "tolerance": RELATIVE_TOLERANCE[dtype] * scale,
    }


def fail_on_parity(
    rows: Iterable[dict], what: str, state_dict: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Raises naming every failed row: a float32 / float64 row above its tolerance, or a row of any dtype whose
    difference is NaN or inf (a lossy cast that makes the outputs non-finite must not pass). bfloat16 / float16
    rows above their (loose) tolerance are reported on the model card, not failed: rounding to 8 or 11 bits of
    mantissa is the user's choice. state_dict (the converted tensors), when given, lets the message name the
    first non-finite tensor."""
    failed = [
        r for r in rows
        if not math.isfinite(r["max_abs_diff"])
        or (r["dtype"] in ("float32", "float64") and not r["max_abs_diff"] <= r["tolerance"])
    ]
    if failed:
        detail = ", ".join(
            f"{r['backend']} on {r['device']} ({r['dtype']}): {r['max_abs_diff']:.3g} > {r['tolerance']:.3g}"
            for r in failed
        )
        message = f"converted model does not match the official {what}: {detail}"
        if any(not math.isfinite(r["max_abs_diff"]) for r in failed):
            bad = first_non_finite(state_dict) if state_dict is not None else None
            message += "; the outputs are not finite" + (
                f" (first non-finite tensor: {bad})" if bad is not None else " (every converted tensor is finite)"
                if state_dict is not None else ""
            )
        raise ConversionError(message)


# ----------------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------------


def save_state_dict_safetensors(
    state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike, *, metadata: Mapping[str, str] | None = None
) -> None:
    """Saves tensors with safetensors; tensors sharing memory (tied weights, views) are stored as copies."""
    from safetensors.torch import save_file

    seen_storages: set[tuple[int, str]] = set()
    prepared: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict[{key!r}] is a {type(tensor).__name__}, not a tensor")
        if tensor.device.type == "meta":
            raise ValueError(f"state_dict[{key!r}] is on the meta device (no data to save)")
        tensor = tensor.detach()
        storage = (tensor.untyped_storage().data_ptr(), str(tensor.device))
        if storage in seen_storages:  # safetensors refuses two names over one storage (ties, chunks of a fusion)
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        else:
            seen_storages.add(storage)
        prepared[key] = tensor.to("cpu").contiguous()
    save_file(prepared, str(path), metadata={"format": "pt", **(metadata or {})})


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    from hf_tiny.io_utils import exchange_paths

    return exchange_paths(a, b)


@contextlib.contextmanager
def atomic_output_dir(
    dst: str | os.PathLike, *, force: bool = False, src: str | os.PathLike | None = None
) -> Iterator[Path]:
    """Yields a fresh temp folder beside dst; on success it becomes dst, on any failure dst is untouched.

    An existing dst is an error unless force=True, raised before any work. With force the old dst is
    swapped out atomically (renameat2 exchange; two renames where unsupported) and then deleted. A run killed
    mid-write leaves only a `.DST.tmp-PID-XXXX` folder beside dst, which the next run removes.
    src (optional): the checkpoint being converted; a dst that is src or contains it is refused, since
    replacing it would delete the source.
    The mechanism is hf_tiny.io_utils.atomic_directory (shared with save_pretrained); imported here lazily so
    that this module stays importable without the model package.
    """
    from hf_tiny.io_utils import atomic_directory, clean_stale_temporaries

    dst = Path(dst).absolute()
    if dst.is_symlink():  # the folder the link points to is replaced; the link stays (see atomic_directory)
        dst = Path(os.path.realpath(dst))
    if src is not None:
        source = Path(src).resolve()
        if dst.resolve() == source or dst.resolve() in source.parents:
            raise ConversionError(f"destination {dst} is (or contains) the source {src}; choose another destination")
    try:
        clean_stale_temporaries(dst)  # first: it may put back a destination a killed --force swap had moved aside
    except OSError as error:
        raise ConversionError(f"cannot clean stale temporary folders beside {dst}: {error}") from error
    if dst.exists() and not force:
        raise ConversionError(f"destination {dst} already exists; pass --force to replace it")
    if dst.exists() and not dst.is_dir():
        raise ConversionError(f"destination {dst} exists and is not a folder; remove it or choose another path")
    stage = "create"  # -> "write" (the caller's block) -> "swap"
    try:
        with atomic_directory(dst, replace=force, exchange=_exchange) as tmp:
            stage = "write"
            yield tmp
            stage = "swap"
    except OSError as error:
        if stage == "create":
            raise ConversionError(f"cannot create an output folder beside {dst}: {error}") from error
        if stage == "swap" and isinstance(error, FileExistsError):
            raise ConversionError(f"destination {dst} appeared while converting; pass --force to replace it") from error
        raise


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "tokenizer.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    # not a tokenizer file, but it belongs with the converted model just the same
    "generation_config.json",
)


# A sentence-transformers model is a folder like any other plus these files and the module folders that
# modules.json names (1_Pooling/, 2_Normalize/, ...). Without them SentenceTransformer(folder) falls back to plain
# mean pooling with no normalisation and max_seq_length 512: other embeddings, silently.
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def copy_tokenizer_files(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
    """Copies the TOKENIZER_FILES present in src_dir into dst_dir, and the sentence-transformers files with the
    module folders of modules.json; returns the names copied."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    if not src_dir.is_dir():
        raise ConversionError(f"tokenizer source {src_dir} is not a folder")
    copied = []
    for name in TOKENIZER_FILES + SENTENCE_TRANSFORMERS_FILES:
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dst_dir / name)
            copied.append(name)
    for folder in _sentence_transformers_module_folders(src_dir):
        shutil.copytree(src_dir / folder, dst_dir / folder)
        copied.append(folder + "/")
    return copied


def _sentence_transformers_module_folders(src_dir: Path) -> list[str]:
    """The module folders modules.json names (its entry of path "" is the model itself, converted here)."""
    modules_path = src_dir / "modules.json"
    if not modules_path.is_file():
        return []
    try:
        modules = json.loads(modules_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"cannot read {modules_path}: {error}") from error
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConversionError(f"{modules_path} must hold a list of module objects (sentence-transformers' format)")
    folders = []
    for module in modules:
        folder = module.get("path", "")
        if not isinstance(folder, str):
            raise ConversionError(f"{modules_path}: module path {folder!r} is not a string")
        if not folder:
            continue
        resolved = (src_dir / folder).resolve()
        if src_dir.resolve() not in resolved.parents:
            raise ConversionError(f"{modules_path}: module path {folder!r} points outside {src_dir}")
        if resolved.is_dir():  # a module without files (Normalize) may have no folder at all
            folders.append(folder)
    return folders


def write_official_folder(
    tmp: Path,
    official_class,
    official_config,
    state: dict,
    src: str | os.PathLike,
    *,
    keep_stored_tied_copies: bool = False,
) -> None:
    """Writes a reverse conversion's official folder into tmp: config.json, model.safetensors (the tensors
    official_class expects, shapes checked on a meta-device instance; tied copies stored once, as save_pretrained
    does) and the tokenizer files of src. keep_stored_tied_copies: a tied copy that `state` holds is written
    too (transformers 5 unties e.g. a T5 head whose stored copy differs). Tensors the class recomputes
    (`_keys_to_ignore_on_save`, e.g. Marian's sinusoidal tables) are not expected, as save_pretrained skips them."""
    with torch.device("meta"):
        reference = official_class(official_config)
    expected = expected_shapes(reference)
    for tied_copy in reference.get_expanded_tied_weights_keys(all_submodels=True):
        if not (keep_stored_tied_copies and tied_copy in state):
            expected.pop(tied_copy, None)
            state.pop(tied_copy, None)
    for recomputed in reference._keys_to_ignore_on_save or ():
        expected.pop(recomputed, None)
    check_shapes(state, expected)
    official_config.save_pretrained(str(tmp))
    save_state_dict_safetensors(state, Path(tmp) / SAFETENSORS_FILE)
    copy_tokenizer_files(src, tmp)


# ----------------------------------------------------------------------------------------------------------------
# Model cards
# ----------------------------------------------------------------------------------------------------------------

MODEL_CARDS_DIR = Path(__file__).resolve().parents[1] / "model_cards"
PARITY_COLUMNS = ("backend", "dtype", "device", "max_abs_diff", "tolerance")
ALWAYS_TAGS = ("hf_tiny", "custom_code")
# Fields a card may omit, with their defaults.
CARD_DEFAULTS = {
    "license": "apache-2.0",
    "tags": (),
    "attention_backends": ("eager", "sdpa", "flash_attention_2"),
    "extra": "",
}


def _yaml_str(value) -> str:
    return json.dumps(str(value))  # a JSON string is a valid YAML double-quoted scalar


def _format_number(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if value != 0 else "0"
    return str(value)


def _parity_table(rows) -> str:
    if not rows:
        raise ValueError("model card field 'parity_rows' must hold at least one measured row")
    lines = ["| backend | dtype | device | max abs diff | tolerance | within tolerance |", "|---|---|---|---|---|---|"]
    for number, row in enumerate(rows):
        if isinstance(row, (tuple, list)) and len(row) == len(PARITY_COLUMNS):
            row = dict(zip(PARITY_COLUMNS, row, strict=True))
        if not isinstance(row, Mapping) or any(column not in row for column in PARITY_COLUMNS):
            raise ValueError(f"parity_rows[{number}] must give {', '.join(PARITY_COLUMNS)}; got {rows[number]!r}")
        within = "yes" if float(row["max_abs_diff"]) <= float(row["tolerance"]) else "NO"
        cells = [_format_number(row[column]) for column in PARITY_COLUMNS] + [within]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Placeholders computed from other fields: {placeholder: the field it is computed from}.
_DERIVED_CARD_FIELDS = {
    "tags_yaml": "tags",
    "parity_table": "parity_rows",
    "attention_backends_list": "attention_backends",
    "base_model_yaml": "base_model",
    "license_yaml": "license",
    "pipeline_tag_yaml": "pipeline_tag",
}


def render_model_card(template_name: str = "hf_tiny", **fields) -> str:
    """Fills model_cards/<template_name>.md ($placeholders) with fields; a missing or unknown field is an error.

    Fields of the hf_tiny template: model_name, model_id (what from_pretrained is given), base_model,
    pipeline_tag, family, auto_class, description, parity_rows (rows of backend, dtype, device,
    max_abs_diff, tolerance, as dicts or 5-tuples); optional: license, tags, attention_backends, extra.
    """
    path = MODEL_CARDS_DIR / f"{template_name}.md"
    if not path.is_file():
        available = _list_names(p.stem for p in MODEL_CARDS_DIR.glob("*.md")) or "none"
        raise ValueError(f"no model card template {template_name!r} in {MODEL_CARDS_DIR} (available: {available})")
    template = string.Template(path.read_text())
    placeholders = {
        match.group("named") or match.group("braced")
        for match in template.pattern.finditer(template.template)
        if match.group("named") or match.group("braced")
    }
    needed = {_DERIVED_CARD_FIELDS.get(name, name) for name in placeholders}
    values = {**CARD_DEFAULTS, **fields}
    missing = sorted(needed - values.keys())
    if missing:
        raise ValueError(f"model card template {template_name!r} needs field(s): {', '.join(missing)}")
    unknown = sorted(fields.keys() - needed - CARD_DEFAULTS.keys())
    if unknown:
        raise ValueError(f"model card template {template_name!r} has no field(s): {', '.join(unknown)}")
    if isinstance(values["tags"], str) or isinstance(values["attention_backends"], str):
        raise TypeError("model card fields 'tags' and 'attention_backends' must be lists of strings")
    tags = list(ALWAYS_TAGS) + [tag for tag in values["tags"] if tag not in ALWAYS_TAGS]
    derived = {
        "tags_yaml": "\n".join(f"  - {_yaml_str(tag)}" for tag in tags),
        "attention_backends_list": ", ".join(f"`{name}`" for name in values["attention_backends"]),
        "license_yaml": _yaml_str(values["license"]),
    }
    for name in ("base_model", "pipeline_tag"):
        if name in values:
            derived[f"{name}_yaml"] = _yaml_str(values[name])
    if "parity_table" in placeholders:
        derived["parity_table"] = _parity_table(values["parity_rows"])
    return template.substitute({**values, **derived})


def write_model_card(dst_dir: str | os.PathLike, template_name: str = "hf_tiny", **fields) -> Path:
    """Renders the card and writes it as dst_dir/README.md; returns the path."""
    path = Path(dst_dir) / "README.md"
    path.write_text(render_model_card(template_name, **fields))
    return path

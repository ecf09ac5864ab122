"""GGUF files: the architecture in the header (for family detection) and the dequantized tensors under
transformers' names, computed exactly as `from_pretrained(dir, gguf_file=...)` computes them.

transformers' own `load_gguf_checkpoint(..., return_tensors=True)` re-parses the file and rebuilds gguf's
tensor-name table once per submodule (~25 s extra for a 100 MB file). Here the tensor table is read once, past
the header's values without decoding them (gguf_tensors), the name table is built once, and the per-tensor work
uses gguf's dequantize and transformers' own tensor processors (which un-permute Llama's q/k, split fused
tensors, ...). Nothing outside this module is patched.
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConversionError, list_names
from .gguf_rope import llama3_rope_parameters
from .lazy import LazyTensors, TensorInfo, release_array_pages

_GGUF_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format (8: string, 9: array are read separately)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@contextlib.contextmanager
def _reading_header(path: Path):
    """Opens the file at its first header field: yields (handle, version, tensor count, field count). A short read
    or undecodable bytes become one ConversionError naming the file."""
    try:
        with open(path, "rb") as handle:
            if handle.read(4) != _GGUF_MAGIC:
                raise ConversionError(f"{path} is not a valid GGUF file (no GGUF magic bytes at its start)")
            yield (handle, *struct.unpack("<IQQ", handle.read(20)))
    except (struct.error, UnicodeDecodeError, OSError, MemoryError) as error:
        raise ConversionError(f"{path} is not a valid GGUF file (truncated or corrupt?): {error}") from error


def _fields(handle, count: int):
    """The header's (key, value type, value) in order; arrays are skipped (None)."""
    for _ in range(count):
        key, kind = _read_string(handle), struct.unpack("<I", handle.read(4))[0]
        yield key, kind, _read_value(handle, kind)


def _header_fields(path: Path, wanted) -> dict:
    """The header fields `wanted(key)` selects, read without touching a tensor."""
    with _reading_header(path) as (handle, _version, _tensors, count):
        return {key: value for key, _kind, value in _fields(handle, count) if wanted(key)}


def gguf_architecture(path: str | os.PathLike) -> str:
    """`general.architecture` read from the header alone (no tensor is touched), for family detection. The walk
    stops at that field, which writers put first: the tokenizer's arrays after it are not even skipped through."""
    path = Path(path)
    with _reading_header(path) as (handle, _version, _tensors, count):
        found = next((value for key, _kind, value in _fields(handle, count) if key == "general.architecture"), None)
    if found is None:
        raise ConversionError(f"{path} has no general.architecture field; cannot tell which model it holds")
    return str(found)


def gguf_special_token_ids(path: str | os.PathLike) -> dict[str, int]:
    """The special tokens the GGUF header names: {"bos": id, "eos": id, "padding": id, "unknown": id} (those set)."""
    prefix, suffix = "tokenizer.ggml.", "_token_id"
    fields = _header_fields(Path(path), lambda key: key.startswith(prefix) and key.endswith(suffix))
    return {key[len(prefix) : -len(suffix)]: int(value) for key, value in fields.items()}


def _read_string(handle) -> str:
    (length,) = struct.unpack("<Q", handle.read(8))
    if length > 1 << 24:
        raise struct.error(f"implausible string length {length}")
    return handle.read(length).decode("utf-8")


def _read_value(handle, kind: int):
    if kind == _STRING:
        return _read_string(handle)
    if kind == _ARRAY:
        element_kind, length = struct.unpack("<IQ", handle.read(12))
        # skipped without decoding (the tokenizer's arrays hold the whole vocabulary); nothing here reads them
        if element_kind in _SCALAR_FORMATS:
            handle.seek(length * struct.calcsize("<" + _SCALAR_FORMATS[element_kind]), os.SEEK_CUR)
        elif element_kind == _STRING:
            for _ in range(length):
                handle.seek(struct.unpack("<Q", handle.read(8))[0], os.SEEK_CUR)
        else:
            for _ in range(length):
                _read_value(handle, element_kind)
        return None
    if kind not in _SCALAR_FORMATS:
        raise struct.error(f"unknown metadata value type {kind}")
    fmt = "<" + _SCALAR_FORMATS[kind]
    return struct.unpack(fmt, handle.read(struct.calcsize(fmt)))[0]


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its name, GGML type, GGML shape (innermost dimension first) and its bytes, a
    read-only view of the memory-mapped file in the layout gguf's `dequantize` takes (what gguf's GGUFReader gives)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: object  # numpy array


def gguf_tensors(path: Path) -> list[GGUFTensor]:
    """The tensor table of a (little-endian) GGUF file, read past the header's values without decoding them.
    gguf's GGUFReader decodes every element of the tokenizer's arrays first: ~14 s for Gemma 3's 262k-token
    vocabulary, which nothing here reads."""
    with _reading_header(path) as (handle, version, tensor_count, field_count):
        if version & 0xFFFF == 0:
            raise ConversionError(f"{path} is a big-endian GGUF file; only little-endian files are read")
        alignment = 32
        for key, kind, value in _fields(handle, field_count):
            if key == "general.alignment":
                alignment = _checked_alignment(path, kind, value)
        entries = [_tensor_entry(handle) for _ in range(tensor_count)]
        data_start = handle.tell() + (-handle.tell()) % alignment
    import numpy as np

    mapped = np.memmap(path, mode="r") if entries else None
    names = [name for name, _, _, _ in entries]
    if len(set(names)) != len(names):
        raise ConversionError(f"{path} holds tensors of the same name twice: "
                              f"{list_names(sorted({n for n in names if names.count(n) > 1}))}")
    return [_mapped_tensor(path, mapped, data_start, *entry) for entry in entries]


def _checked_alignment(path: Path, kind: int, value) -> int:
    if kind != 4 or not value or value & (value - 1):
        raise ConversionError(f"{path}: general.alignment must be a uint32 power of two, got {value!r} (type {kind})")
    return value


def _tensor_entry(handle) -> tuple[str, tuple[int, ...], int, int]:
    name = _read_string(handle)
    (n_dims,) = struct.unpack("<I", handle.read(4))
    if n_dims > 8:
        raise struct.error(f"tensor {name!r} has {n_dims} dimensions")
    dims = struct.unpack(f"<{n_dims}Q", handle.read(8 * n_dims))
    raw_type, offset = struct.unpack("<IQ", handle.read(12))
    return name, dims, raw_type, offset


def _mapped_tensor(path: Path, mapped, data_start: int, name: str, dims: tuple, raw_type: int, offset: int):
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    try:
        kind = GGMLQuantizationType(raw_type)
    except ValueError:
        raise ConversionError(f"{path}: tensor {name!r} has GGML type {raw_type}, which gguf does not know") from None
    block, type_size = GGML_QUANT_SIZES[kind]
    elements = int(np.prod(dims, dtype=np.int64))
    begin, size = data_start + offset, elements * type_size // block
    if begin + size > mapped.size:
        raise ConversionError(f"{path} is not a valid GGUF file (truncated): tensor {name!r} needs bytes "
                              f"{begin}..{begin + size}, the file has {mapped.size}")
    shape = tuple(reversed(dims))
    data = mapped[begin : begin + size]
    plain = _PLAIN_GGML_DTYPES.get(kind.name)
    data = data.view(plain).reshape(shape) if plain else data.reshape(quant_shape_to_byte_shape(shape, kind))
    return GGUFTensor(name, kind, tuple(dims), data)


# GGML types stored as plain numbers (no blocks): gguf's reader views their bytes as these
_PLAIN_GGML_DTYPES = {"F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "I16": "int16",
                      "I32": "int32", "I64": "int64"}


def _dequantizable_types() -> set:
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


def official_meta_model(config: dict):
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


def _gguf_to_transformers_names(model, processor, architecture: str, num_layers: int) -> dict[str, str]:
    """{GGUF tensor name: transformers name}, as transformers' get_gguf_hf_weights_map computes it (every
    submodule's names, the outer module's mapping winning), with gguf's name table built once."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, name in MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:
        raise ConversionError(f"the installed gguf package does not know the GGUF architecture {architecture!r}")
    table = get_tensor_name_map(arch, num_layers)
    names: dict[str, str] = {}
    for prefix, module in model.named_modules():
        qualifier = f"{prefix}." if prefix else ""
        level: dict[str, str] = {}
        for hf_name in module.state_dict():
            hf_name = processor.preprocess_name(hf_name)
            stem, suffix = hf_name, ""
            if hf_name.endswith((".weight", ".bias")):
                stem, suffix = hf_name.rsplit(".", 1)
                suffix = "." + suffix
            gguf_name = table.get_name(stem)
            if gguf_name is None:
                processor.perform_fallback_tensor_mapping(level, suffix, qualifier, hf_name)
            else:
                level[gguf_name + suffix] = qualifier + hf_name
        for key, value in level.items():
            names.setdefault(key, value)
    return names


def _checked_architecture(path: Path, expected_architecture: str | tuple[str, ...]) -> str:
    expected = (expected_architecture,) if isinstance(expected_architecture, str) else tuple(expected_architecture)
    architecture = gguf_architecture(path)
    if architecture not in expected:
        raise ConversionError(
            f"{path} is a GGUF of architecture {architecture!r}, expected {' or '.join(map(repr, expected))}"
        )
    return architecture


def _checked_tensors(path: Path) -> list[GGUFTensor]:
    """The file's tensor table, after checking that every tensor's quantization type can be dequantized."""
    tensors = gguf_tensors(path)
    supported = _dequantizable_types()
    unsupported = [f"{t.name} ({t.tensor_type.name})" for t in tensors if t.tensor_type not in supported]
    if unsupported:
        raise ConversionError(
            f"{path}: cannot dequantize tensor(s) with unsupported quantization type: {list_names(unsupported)}; "
            f"supported types: {list_names(t.name for t in supported)}"
        )
    return tensors


@dataclass
class _Opened:
    """A checked GGUF file: transformers' config dict, its tensors, transformers' tensor processor for the
    architecture and {GGUF tensor name: transformers name}."""

    config: dict
    tensors: list[GGUFTensor]
    processor: object
    names: dict[str, str]


def _rope_freqs_read(path: Path, tensors: list[GGUFTensor], names: dict, config: dict) -> list[GGUFTensor]:
    """llama.cpp stores Llama 3.1+'s RoPE scaling as per-frequency factors, `rope_freqs.weight`, which transformers
    has no name for (it drops the tensor and computes RoPE unscaled). All ones, the tensor is dropped; else the
    factors become the config's llama3 `rope_parameters` (gguf_rope), or are refused. Returns the other tensors."""
    freqs = [t for t in tensors if t.name == "rope_freqs.weight" and t.name not in names]
    if not freqs:
        return tensors
    from gguf import dequantize

    factors = torch.from_numpy(dequantize(freqs[0].data, freqs[0].tensor_type).copy())
    if (factors != 1).any():
        config["rope_parameters"] = llama3_rope_parameters(path, factors, config)
    return [t for t in tensors if t is not freqs[0]]


def _opened(path: Path, expected_architecture: str | tuple[str, ...]) -> _Opened:
    """The architecture and every tensor's quantization type checked, every GGUF tensor given a transformers name;
    nothing dequantized."""
    if not path.is_file():
        raise ConversionError(f"GGUF file {path} does not exist")
    try:
        import gguf  # noqa: F401

        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, load_gguf_checkpoint
    except ImportError as error:
        raise ConversionError(f"reading GGUF needs the `gguf` package (pip install gguf): {error}") from error
    architecture = _checked_architecture(path, expected_architecture)
    tensors = _checked_tensors(path)
    try:
        config = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
        model = official_meta_model(config)
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
        names = _gguf_to_transformers_names(model, processor, architecture, model.config.num_hidden_layers)
    except (ValueError, KeyError, NotImplementedError, OSError) as error:
        raise ConversionError(f"cannot read GGUF file {path}: {type(error).__name__}: {error}") from error
    tensors = _rope_freqs_read(path, tensors, names, config)
    unmapped = [t.name for t in tensors if t.name not in names]
    if unmapped:
        raise ConversionError(
            f"{path}: GGUF tensors with no transformers name for architecture {architecture!r}: {list_names(unmapped)}"
        )
    return _Opened(config, tensors, processor, names)


def load_gguf(
    path: str | os.PathLike, *, expected_architecture: str | tuple[str, ...], dtype: torch.dtype | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Reads a GGUF file into (transformers config dict, dequantized state dict with transformers names).

    The architecture and every tensor's quantization type are checked before anything is dequantized, and
    every GGUF tensor must get a transformers name.
    """
    path = Path(path)
    return _dequantized_state(path, _opened(path, expected_architecture), dtype)


def _dequantized_state(path: Path, opened: _Opened, dtype: torch.dtype | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Every tensor of a checked file dequantized and processed: (config dict, state dict)."""
    import numpy as np
    from gguf import dequantize

    config, processor, names = opened.config, opened.processor, opened.names
    try:
        parsed = {"config": config, "tensors": {}}
        state: dict[str, torch.Tensor] = {}
        for tensor in opened.tensors:
            weights = dequantize(tensor.data, tensor.tensor_type)
            result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed)
            if result.name not in names:  # a processor may consume a tensor into another (e.g. fused experts)
                continue
            value = torch.from_numpy(np.copy(result.weights))
            state[names[result.name]] = value if dtype is None else value.to(dtype)
        # tensors a processor stored under their final name itself (GPT-2's output.weight -> lm_head.weight)
        for name, value in parsed["tensors"].items():
            state.setdefault(name, value if dtype is None else value.to(dtype))
    except (ValueError, KeyError, NotImplementedError, OSError) as error:
        raise ConversionError(f"cannot read GGUF file {path}: {type(error).__name__}: {error}") from error
    return config, state


# transformers' tensor processors that turn each GGUF tensor into one tensor of the same shape under its own name
# (Llama's q/k un-permutation, Gemma's norm offset, none): files of these architectures are read one tensor at a
# time; the others (which merge experts, or store a tensor aside under another name) are read whole.
PER_TENSOR_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor")


def open_gguf(path: str | os.PathLike, *, expected_architecture: str | tuple[str, ...]) -> tuple[dict, LazyTensors]:
    """load_gguf, lazily: (transformers config dict, the tensors under transformers names), each tensor
    dequantized and processed when it is read, its mapped pages given back afterwards."""
    path = Path(path)
    opened = _opened(path, expected_architecture)
    if type(opened.processor).__name__ not in PER_TENSOR_PROCESSORS:
        config, state = _dequantized_state(path, opened, None)
        return config, LazyTensors.of(state)
    tensors = {opened.names[tensor.name]: tensor for tensor in opened.tensors}
    infos = {name: _dequantized_info(tensor) for name, tensor in tensors.items()}
    return opened.config, LazyTensors(infos, lambda name: _read_gguf_tensor(path, opened, tensors[name], infos[name]))


def _dequantized_info(tensor) -> TensorInfo:
    """Shape and dtype of a tensor as gguf's dequantize gives it: GGML lists dimensions innermost first; every
    type comes out float32."""
    return TensorInfo(tuple(int(size) for size in reversed(tensor.shape)), torch.float32)


def _read_gguf_tensor(path: Path, opened: _Opened, tensor, info: TensorInfo) -> torch.Tensor:
    import numpy as np
    from gguf import dequantize

    try:
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = opened.processor.process(weights=weights, name=tensor.name, tensor_key_mapping=opened.names,
                                          parsed_parameters={"config": opened.config, "tensors": {}})
        value = torch.from_numpy(np.copy(result.weights))
    except (ValueError, KeyError, NotImplementedError, OSError) as error:
        raise ConversionError(f"cannot read GGUF file {path}: {type(error).__name__}: {error}") from error
    release_array_pages(tensor.data)
    if result.name != tensor.name or tuple(value.shape) != info.shape or value.dtype != info.dtype:
        raise ConversionError(f"{path}: GGUF tensor {tensor.name!r} came out of transformers' "
                              f"{type(opened.processor).__name__} as {result.name!r} {tuple(value.shape)} "
                              f"{value.dtype}, planned {info.shape} {info.dtype}")
    return value

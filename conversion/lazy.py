"""Checkpoints read lazily: names, shapes and dtypes at once, each tensor's bytes only when it is asked for.

A conversion holds one tensor (or one rule's group) at a time, so it streams a checkpoint of any size:

- safetensors: the header is parsed here and each tensor is read with one positioned read into its own buffer
  (no memory map: the pages of a mapped file count in the process's resident memory once touched);
- .bin / .pt / .pth (torch zip files, `weights_only`): torch's memory map, each tensor copied out on access and
  its mapped pages given back to the kernel;
- anything already in memory (a warm-started official model, a GGUF of an architecture whose tensors
  transformers converts together): wrapped as it is.

`LazyTensors` is a read-only Mapping: `state[key]` reads the tensor again on every access, so whoever holds
one decides how long it lives. Views (`without`, `renamed`, `with_tensors`) build the tensors a family's plan
needs without reading anything.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConversionError

# safetensors dtype names (the format's spec) <-> torch
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


class LazyTensors(Mapping):
    """name -> tensor, read when asked. infos: {name: TensorInfo}; read(name) -> tensor."""

    def __init__(self, infos: Mapping[str, TensorInfo], read: Callable[[str], torch.Tensor]):
        self._infos = dict(infos)
        self._read = read

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> "LazyTensors":
        """Tensors already in memory."""
        if isinstance(tensors, LazyTensors):
            return tensors
        tensors = dict(tensors)
        return cls({k: TensorInfo(tuple(v.shape), v.dtype) for k, v in tensors.items()}, tensors.__getitem__)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._infos:
            raise KeyError(key)
        return self._read(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, key) -> bool:
        return key in self._infos

    def info(self, key: str) -> TensorInfo:
        return self._infos[key]

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self._infos.values())

    def without(self, keys: Iterable[str]) -> "LazyTensors":
        dropped = set(keys)
        return LazyTensors({k: v for k, v in self._infos.items() if k not in dropped}, self._read)

    def renamed(self, rename: Callable[[str], str | None]) -> "LazyTensors":
        """The same tensors under rename(name); a name renamed to None is left out."""
        original = {}
        for key in self._infos:
            new = rename(key)
            if new is not None:
                if new in original:
                    raise ConversionError(f"{original[new]!r} and {key!r} would both be read as {new!r}")
                original[new] = key
        return LazyTensors({new: self._infos[old] for new, old in original.items()},
                           lambda key: self._read(original[key]))

    def with_tensors(self, extra: Mapping[str, tuple[TensorInfo, Callable[[], torch.Tensor]]]) -> "LazyTensors":
        """These tensors added (or replacing ones of the same name): {name: (info, make)}."""
        infos = {**self._infos, **{k: info for k, (info, _) in extra.items()}}
        makers = {k: make for k, (_, make) in extra.items()}
        return LazyTensors(infos, lambda key: makers[key]() if key in makers else self._read(key))

    def aliased(self, aliases: Mapping[str, str]) -> "LazyTensors":
        """{new name: existing name}: the existing tensors also read under the new names."""
        return self.with_tensors({new: (self._infos[old], lambda old=old: self._read(old)) for new, old in aliases.items()})


# ---- safetensors ------------------------------------------------------------------------------------------------


def safetensors_header(path: Path) -> tuple[int, dict]:
    """(offset of the data, {name: entry}) of a safetensors file, checked against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {length} exceeds the file ({size} bytes)")
            header = json.loads(handle.read(length))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as error:
        raise ConversionError(f"{path} is not a valid safetensors file (truncated or corrupt?): {error}") from error
    if not isinstance(header, dict):
        raise ConversionError(f"{path} is not a valid safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    data_start, end = 8 + length, 0
    for name, entry in header.items():
        try:
            begin, stop = entry["data_offsets"]
            info = TensorInfo(tuple(int(s) for s in entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]])
        except (KeyError, TypeError, ValueError) as error:
            raise ConversionError(f"{path} is not a valid safetensors file: bad entry for {name!r}: {error}") from error
        if stop - begin != info.nbytes or begin < 0:
            raise ConversionError(f"{path} is not a valid safetensors file: {name!r} spans {stop - begin} bytes, "
                                  f"its shape and dtype need {info.nbytes}")
        end = max(end, stop)
    if data_start + end != size:
        raise ConversionError(f"{path} is not a valid safetensors file (truncated or corrupt?): its header describes "
                              f"{data_start + end} bytes, the file has {size}")
    return data_start, header


def read_safetensors(paths: Iterable[Path]) -> LazyTensors:
    """The tensors of one or more safetensors files (a name in two files is an error)."""
    infos, places = {}, {}
    for path in paths:
        data_start, header = safetensors_header(path)
        for name, entry in header.items():
            if name in infos:
                raise ConversionError(f"tensor {name!r} is stored twice: in {places[name][0]} and {path}")
            infos[name] = TensorInfo(tuple(entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]])
            places[name] = (path, data_start + entry["data_offsets"][0])

    def read(name: str) -> torch.Tensor:
        path, offset = places[name]
        info = infos[name]
        buffer = bytearray(info.nbytes)
        if info.nbytes:
            with open(path, "rb") as handle:
                handle.seek(offset)
                if handle.readinto(buffer) != info.nbytes:
                    raise ConversionError(f"{path}: tensor {name!r} is cut short (truncated file?)")
            return torch.frombuffer(buffer, dtype=info.dtype).reshape(info.shape)
        return torch.empty(info.shape, dtype=info.dtype)

    return LazyTensors(infos, read)


# ---- torch zip files --------------------------------------------------------------------------------------------

_MADV_DONTNEED = 4
_libc = None


def release_pages(tensor: torch.Tensor) -> None:
    """Gives the memory-mapped pages under `tensor` back to the kernel (they are re-read if touched again), so a
    streamed file does not accumulate in resident memory. A no-op where madvise is unavailable."""
    global _libc
    if os.name != "posix" or tensor.numel() == 0:
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        start = tensor.data_ptr() // page * page
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def read_torch_files(paths: Iterable[Path], load: Callable[[Path], tuple[Mapping, bool]]) -> LazyTensors:
    """The tensors of torch files: load(path) -> (state dict, whether its tensors are memory-mapped from the file,
    as torch.load(mmap=True) maps them; only then are their pages given back after each read)."""
    infos, where = {}, {}
    for path in paths:
        state, mapped = load(path)
        for name, tensor in state.items():
            if name in infos:
                raise ConversionError(f"tensor {name!r} is stored twice: in {where[name][0]} and {path}")
            infos[name] = TensorInfo(tuple(tensor.shape), tensor.dtype)
            where[name] = (path, state, mapped)

    def read(name: str) -> torch.Tensor:
        _path, state, mapped = where[name]
        if not mapped:
            return state[name]
        copy = state[name].clone()
        release_pages(state[name])
        return copy

    return LazyTensors(infos, read)

"""Checkpoints read lazily: names, shapes and dtypes at once, each tensor's bytes only when it is asked for.

A conversion holds one tensor (or one rule's group, or one layer per parity run) at a time, so it streams a
checkpoint of any size:

- safetensors: the header is parsed here and each tensor (or a block of its rows, `rows`) is read with positioned
  reads into a fresh buffer or a reused one (`BufferPool`, `read_reusing`); no memory map: the pages of a mapped
  file count in the process's resident memory once touched;
- .bin / .pt / .pth (torch zip files, `weights_only`): torch's memory map, each tensor copied out on access and
  its mapped pages given back to the kernel (GGUF files alike, in gguf_files.py);
- anything already in memory (a warm-started official model, a GGUF of an architecture whose tensors
  transformers converts together): wrapped as it is.

`LazyTensors` is a read-only Mapping: `state[key]` reads the tensor again on every access, so whoever holds
one decides how long it lives. Views (`without`, `renamed`, `with_tensors`, `joined`) build the tensors a family's
plan needs without reading anything.
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
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


class LazyTensors(Mapping):
    """name -> tensor, read when asked. infos: {name: TensorInfo}; read(name) -> tensor. rows(name, start, stop,
    out) -> rows start:stop of the tensor's first dimension, written into `out` when given (default: read the
    tensor, then slice)."""

    def __init__(self, infos: Mapping[str, TensorInfo], read: Callable[[str], torch.Tensor], *,
                 rows: Callable | None = None):
        self._infos = dict(infos)
        self._read = read
        self._rows = rows

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> "LazyTensors":
        """Tensors already in memory."""
        if isinstance(tensors, LazyTensors):
            return tensors
        tensors = dict(tensors)
        return cls({k: TensorInfo(tuple(v.shape), v.dtype) for k, v in tensors.items()}, tensors.__getitem__)

    @classmethod
    def joined(cls, owners: Mapping[str, "LazyTensors"]) -> "LazyTensors":
        """{name: the LazyTensors holding it} as one (the shards of a checkpoint)."""
        return cls({key: part.info(key) for key, part in owners.items()}, lambda key: owners[key][key],
                   rows=lambda key, start, stop, out: owners[key].rows(key, start, stop, out))

    def _view(self, infos: Mapping[str, TensorInfo], read: Callable, rows: Callable | None) -> "LazyTensors":
        return LazyTensors(infos, read, rows=rows)

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

    def rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows start:stop (first dimension) of a tensor, read alone where the storage allows it."""
        if key not in self._infos:
            raise KeyError(key)
        rows = self._infos[key].shape[0] if self._infos[key].shape else 0
        if not 0 <= start <= stop <= rows:
            raise ValueError(f"{key}: rows {start}:{stop} are outside its {rows} rows")
        if self._rows is not None:
            return self._rows(key, start, stop, out)
        value = self._read(key)[start:stop]
        return value if out is None else out.copy_(value)

    def read_reusing(self, key: str, pool: "BufferPool") -> torch.Tensor:
        """The tensor, read into a spare buffer of `pool` (give it back when done with it)."""
        info = self._infos[key]
        if not info.shape:
            return self[key]
        return self.rows(key, 0, info.shape[0], pool.take(info.shape, info.dtype))

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self._infos.values())

    def without(self, keys: Iterable[str]) -> "LazyTensors":
        dropped = set(keys)
        return self._view({k: v for k, v in self._infos.items() if k not in dropped}, self._read, self._rows)

    def renamed(self, rename: Callable[[str], str | None]) -> "LazyTensors":
        """The same tensors under rename(name); a name renamed to None is left out."""
        original = {}
        for key in self._infos:
            new = rename(key)
            if new is not None:
                if new in original:
                    raise ConversionError(f"{original[new]!r} and {key!r} would both be read as {new!r}")
                original[new] = key
        rows = None if self._rows is None else (lambda key, *args: self._rows(original[key], *args))
        return self._view({new: self._infos[old] for new, old in original.items()},
                          lambda key: self._read(original[key]), rows)

    def with_tensors(self, extra: Mapping[str, tuple[TensorInfo, Callable[[], torch.Tensor]]]) -> "LazyTensors":
        """These tensors added (or replacing ones of the same name): {name: (info, make)}."""
        infos = {**self._infos, **{k: info for k, (info, _) in extra.items()}}
        makers = {k: make for k, (_, make) in extra.items()}

        def rows(key, start, stop, out):
            if key in makers or self._rows is None:
                value = (makers[key]() if key in makers else self._read(key))[start:stop]
                return value if out is None else out.copy_(value)
            return self._rows(key, start, stop, out)

        return self._view(infos, lambda key: makers[key]() if key in makers else self._read(key), rows)

    def aliased(self, aliases: Mapping[str, str]) -> "LazyTensors":
        """{new name: existing name}: the existing tensors also read under the new names."""
        return self.with_tensors({new: (self._infos[old], lambda old=old: self._read(old)) for new, old in aliases.items()})


class BufferPool:
    """Spare CPU tensors by shape and dtype: each layer's tensors reuse the memory of the layer before. A fresh
    tensor of this size is mapped from the OS and faulted in page by page, and given back when freed: for a large
    checkpoint that costs as much as reading it. Tensors over MAX_POOLED_BYTES (embeddings) are not kept."""

    MAX_POOLED_BYTES = 1 << 30

    def __init__(self):
        self.spare: dict[tuple, list[torch.Tensor]] = {}

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        spare = self.spare.get((tuple(shape), dtype))
        return spare.pop() if spare else torch.empty(shape, dtype=dtype)

    def clear(self) -> None:
        self.spare = {}

    def give(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            if tensor.device.type == "cpu" and tensor.nbytes <= self.MAX_POOLED_BYTES:
                self.spare.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)


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


class _SafetensorsFile:
    """One file's tensors: each read with positioned reads straight into a fresh (not zero-filled) buffer or the
    caller's."""

    def __init__(self, path: Path):
        self.path = path
        self.data_start, self.header = safetensors_header(path)

    def read(self, name: str, info: TensorInfo, start: int, stop: int, out: torch.Tensor | None) -> torch.Tensor:
        row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else info.nbytes
        count = (stop - start) * row_bytes if info.shape else info.nbytes
        shape = ((stop - start), *info.shape[1:]) if info.shape else ()
        if out is None:
            out = torch.empty(shape, dtype=info.dtype)
        elif tuple(out.shape) != tuple(shape) or out.dtype != info.dtype or not out.is_contiguous():
            raise ValueError(f"{name}: rows {start}:{stop} are {shape} {info.dtype}, got a buffer "
                             f"{tuple(out.shape)} {out.dtype}")
        if count == 0:
            return out
        offset = self.data_start + self.header[name]["data_offsets"][0] + start * row_bytes
        buffer, done = memoryview(out.view(-1).view(torch.uint8).numpy()), 0
        descriptor = os.open(self.path, os.O_RDONLY)
        try:
            while done < count:
                got = os.preadv(descriptor, [buffer[done:count]], offset + done)
                if got == 0:
                    raise ConversionError(f"{self.path}: tensor {name!r} is cut short (truncated file?)")
                done += got
        finally:
            os.close(descriptor)
        return out


def read_safetensors(paths: Iterable[Path]) -> LazyTensors:
    """The tensors of one or more safetensors files (a name in two files is an error)."""
    infos, places = {}, {}
    for path in paths:
        file = _SafetensorsFile(path)
        for name, entry in file.header.items():
            if name in infos:
                raise ConversionError(f"tensor {name!r} is stored twice: in {places[name].path} and {path}")
            infos[name] = TensorInfo(tuple(entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]])
            places[name] = file

    def rows(name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return places[name].read(name, infos[name], start, stop, out)

    def read(name: str) -> torch.Tensor:
        info = infos[name]
        return rows(name, 0, info.shape[0] if info.shape else 1)

    return LazyTensors(infos, read, rows=rows)


# ---- torch zip files --------------------------------------------------------------------------------------------

_MADV_DONTNEED = 4
_libc = None


def release_pages(tensor: torch.Tensor) -> None:
    """Gives the memory-mapped pages under `tensor` back to the kernel (they are re-read if touched again), so a
    streamed file does not accumulate in resident memory. A no-op where madvise is unavailable."""
    _release(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def release_array_pages(array) -> None:
    """release_pages for a numpy array (a view of a numpy memmap, as gguf's reader gives)."""
    _release(array.ctypes.data, array.nbytes)


def _release(address: int, length: int) -> None:
    global _libc
    if os.name != "posix" or length == 0:
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        start = address // page * page
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + length - start), _MADV_DONTNEED)
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

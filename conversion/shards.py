"""Writing safetensors shards as tensors are produced, the way `save_pretrained` lays them out.

The shapes and dtypes of every tensor are known before the first one is computed (the key map's plan), so each
shard's header is written first and each tensor goes straight to its place in its file: one tensor in memory
at a time, whatever the model's size. Shard names, the split (huggingface_hub's split_torch_state_dict_into_shards,
as save_pretrained uses it) and model.safetensors.index.json are save_pretrained's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from .errors import ConversionError, list_names
from .lazy import SAFETENSORS_DTYPES, TensorInfo

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "50GB"  # save_pretrained's default in transformers 5
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def parse_max_shard_size(value: int | str | None) -> int:
    """save_pretrained's max_shard_size ("5GB", "500MB" or a number of bytes) as bytes; None: the default."""
    from huggingface_hub.serialization._base import parse_size_to_int

    if value is None:
        value = DEFAULT_MAX_SHARD_SIZE
    try:
        size = value if isinstance(value, int) and not isinstance(value, bool) else parse_size_to_int(str(value))
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"max_shard_size must be a positive size such as '5GB', '500MB' or a number of bytes, "
                         f"got {value!r}")
    return size


class ShardWriter:
    """Writes the tensors `infos` announces (in any order, each exactly once) into folder's shards.

    infos: {name: TensorInfo}, in the order save_pretrained would see the state dict."""

    def __init__(self, folder: Path, infos: Mapping[str, TensorInfo], *, max_shard_size: int | str | None = None,
                 metadata: Mapping[str, str] | None = None, total_parameters: int | None = None):
        from huggingface_hub import split_torch_state_dict_into_shards

        self.folder, self.infos, self.total_parameters = Path(folder), dict(infos), total_parameters
        split = split_torch_state_dict_into_shards(
            {name: info.meta() for name, info in self.infos.items()},
            filename_pattern=SAFE_WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
            max_shard_size=parse_max_shard_size(max_shard_size),
        )
        self.split = split
        self.places: dict[str, tuple[int, int]] = {}  # name -> (file descriptor, absolute offset)
        self.files: dict[str, int] = {}
        for filename, names in split.filename_to_tensors.items():
            self.files[filename] = self._open_shard(filename, names, metadata or {})
        self.written: set[str] = set()

    def _open_shard(self, filename: str, names: list[str], metadata: Mapping[str, str]) -> int:
        header, offset = {"__metadata__": {"format": "pt", **metadata}}, 0
        for name in names:
            info = self.infos[name]
            if info.dtype not in _DTYPE_NAMES:
                raise ConversionError(f"tensor {name!r}: safetensors cannot store dtype {info.dtype}")
            header[name] = {"dtype": _DTYPE_NAMES[info.dtype], "shape": list(info.shape),
                            "data_offsets": [offset, offset + info.nbytes]}
            offset += info.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        data_start = 8 + len(encoded)
        descriptor = os.open(self.folder / filename, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        os.write(descriptor, len(encoded).to_bytes(8, "little") + encoded)
        os.ftruncate(descriptor, data_start + offset)
        for name in names:
            self.places[name] = (descriptor, data_start + header[name]["data_offsets"][0])
        return descriptor

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.infos:
            raise ConversionError(f"tensor {name!r} was not planned for this folder")
        if name in self.written:
            raise ConversionError(f"tensor {name!r} written twice")
        info = self.infos[name]
        if tuple(tensor.shape) != info.shape or tensor.dtype != info.dtype:
            raise ConversionError(f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, planned "
                                  f"{info.shape} {info.dtype}")
        descriptor, offset = self.places[name]
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.pwrite(descriptor, view[done:], offset + done)
        self.written.add(name)

    def close(self) -> list[str]:
        """Checks every planned tensor was written, writes the index of a sharded folder; returns the files."""
        for descriptor in self.files.values():
            os.close(descriptor)
        self.files_written = list(self.files)
        self.files = {}
        missing = [name for name in self.infos if name not in self.written]
        if missing:
            raise ConversionError(f"tensors planned but never written: {list_names(missing)}")
        if self.split.is_sharded:
            counts = {} if self.total_parameters is None else {"total_parameters": self.total_parameters}
            index = {"metadata": {**counts, **self.split.metadata},
                     "weight_map": self.split.tensor_to_filename}
            (self.folder / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            return [*self.files_written, SAFE_WEIGHTS_INDEX_NAME]
        return self.files_written

    def abort(self) -> None:
        for descriptor in self.files.values():
            os.close(descriptor)
        self.files = {}

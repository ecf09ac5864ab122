"""dtype handling of converted tensors: parsing --dtype, casting without silent overflow."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .errors import ConversionError

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


def declared_dtype(raw_config: dict) -> torch.dtype | None:
    """The dtype a config.json names (`dtype`, or `torch_dtype` before transformers 5), which from_pretrained loads
    the weights in by default; None where it names none of float32 / bfloat16 / float16 (absent, "auto")."""
    name = raw_config.get("dtype") or raw_config.get("torch_dtype")
    return _DTYPES.get(name) if isinstance(name, str) else None


def cast_floating(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """cast_tensor of every tensor."""
    return {key: cast_tensor(key, value, dtype) for key, value in state_dict.items()}


def cast_tensor(key: str, value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A floating-point tensor cast to dtype (None: unchanged); integer/bool tensors keep their dtype.

    A cast that turns finite values into inf (|value| above the dtype's largest number, e.g. 65504 in float16) is
    an error naming the dtype and the tensor: such a model would compute NaN."""
    if dtype is None or not value.is_floating_point():
        return value
    cast = value.to(dtype)
    if dtype.itemsize < value.dtype.itemsize or torch.finfo(dtype).max < torch.finfo(value.dtype).max:
        overflow = torch.isinf(cast) & torch.isfinite(value)
        if bool(overflow.any()):
            largest = float(value[overflow].abs().max())
            name = str(dtype).removeprefix("torch.")
            raise ConversionError(
                f"--dtype {name}: tensor {key} holds {largest:.6g}, beyond the largest {name} number "
                f"({torch.finfo(dtype).max:.6g}); the cast would make it inf. Convert to float32 or bfloat16 instead"
            )
    return cast

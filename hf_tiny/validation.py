"""Checks shared by configs and forwards. Every error names the field and the value it got."""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def check_positive(owner: str, **fields) -> None:
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


def check_probability(owner: str, **fields) -> None:
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ValueError(f"{owner}: {name} must be a float in [0, 1), got {value!r}")


def check_divisible(owner: str, numerator_name: str, numerator: int, denominator_name: str, denominator: int) -> None:
    if numerator % denominator != 0:
        raise ValueError(
            f"{owner}: {numerator_name} ({numerator}) must be divisible by {denominator_name} ({denominator})"
        )


def check_choice(owner: str, field: str, value, choices: Iterable) -> None:
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{owner}: unknown {field} {value!r}; choose one of {choices}")


def check_input_ids(input_ids: torch.Tensor, *, vocab_size: int, field: str = "input_ids") -> None:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{field} must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"{field} must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"{field} must be 2-D [batch, sequence], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0:
        raise ValueError(f"{field} is an empty batch (shape {tuple(input_ids.shape)})")
    if input_ids.numel() == 0:
        return
    if torch.compiler.is_compiling():
        return  # data-dependent checks would break the graph; eager runs already checked the same code path
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{field} contains token id {bad}, outside the vocabulary [0, {vocab_size})")


def check_sequence_length(length: int, *, limit: int, field: str = "sequence length", limit_name: str = "max_position_embeddings") -> None:
    if length > limit:
        raise ValueError(f"{field} {length} exceeds {limit_name}={limit}")


def check_attention_mask(
    attention_mask: Optional[torch.Tensor], *, expected_shape: tuple, field: str = "attention_mask"
) -> None:
    """A 2-D padding mask must be [batch, keys] of 0/1 (bool or integer or float); 4-D masks pass through."""
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{field} must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.dim() == 4:
        return
    if tuple(attention_mask.shape) != tuple(expected_shape):
        raise ValueError(
            f"{field} has shape {tuple(attention_mask.shape)} but the input needs {tuple(expected_shape)}"
        )
    if attention_mask.is_complex():
        raise TypeError(f"{field} must be bool, integer or float 0/1, got dtype {attention_mask.dtype}")

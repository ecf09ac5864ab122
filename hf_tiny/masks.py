"""Attention masks in one representation: a bool tensor [B, 1, Sq, Sk], True = attend, plus an `is_causal` flag.

A mask is None when nothing needs masking beyond plain causality (no padding, Sq == Sk or a single new query):
then backends take their fast path (SDPA's causal kernel, flash without varlen) instead of reading a 4-D tensor.

Padding rules (the same in every family):
- keys that are padding are never attended to;
- in causal self-attention, padding queries are fully masked too, so they give zeros in every backend
  (their outputs are never used: generation reads the last position, losses ignore padded labels).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .attention import causal_bool_mask


class AttentionMask(NamedTuple):
    mask: Optional[torch.Tensor]
    is_causal: bool


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _has_padding(attention_mask: torch.Tensor) -> bool:
    # A data-dependent check; under torch.compile we always build the mask instead of branching on data.
    return _is_compiling() or not bool(attention_mask.all())


# An additive mask value at or below this is "masked": exp(-1e4) is 0 in every dtype (the oldest convention,
# BERT's -10000.0, and finfo.min both qualify). Values between it and 0 are biases, which a bool mask cannot hold.
_MASKED_AT_OR_BELOW = -1e4


def ready_4d_mask(attention_mask: torch.Tensor, *, query_length: int, key_length: int) -> torch.Tensor:
    """Accepts a caller's 4-D mask: bool (True = attend) as it is, float additive (0 = attend, large negative =
    masked, e.g. transformers' eager masks) as a bool, integer 1/0 as a bool."""
    if attention_mask.dim() != 4 or attention_mask.shape[-2:] != (query_length, key_length):
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)} does not match {query_length} queries and "
            f"{key_length} keys; expected [batch, 1, {query_length}, {key_length}]"
        )
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.is_floating_point():
        attend = attention_mask == 0
        if not _is_compiling():
            ambiguous = ~attend & (attention_mask > _MASKED_AT_OR_BELOW)
            if bool(ambiguous.any()):
                raise ValueError(
                    "a float 4-D attention_mask must hold 0 (attend) or a large negative value <= "
                    f"{_MASKED_AT_OR_BELOW:g} (masked); it holds {attention_mask[ambiguous][0].item()!r}. Pass an "
                    "additive bias through masks.with_position_bias, or a bool mask"
                )
        return attend
    return attention_mask != 0


def _check_2d_mask(attention_mask: torch.Tensor, *, batch_size: int, key_length: int, field: str) -> None:
    if tuple(attention_mask.shape) != (batch_size, key_length):
        raise ValueError(
            f"{field} of shape {tuple(attention_mask.shape)} does not match batch_size={batch_size} and "
            f"key_length={key_length} (cached + new tokens); expected [{batch_size}, {key_length}]"
        )


def self_attention_mask(
    attention_mask: Optional[torch.Tensor],
    *,
    batch_size: int,
    query_length: int,
    key_length: int,
    causal: bool,
    sliding_window: Optional[int] = None,
    device: torch.device,
) -> AttentionMask:
    """Mask for self-attention of `query_length` new tokens over `key_length` keys (cached + new).

    attention_mask: None, a 2-D [B, key_length] tensor of 1 (real token) / 0 (padding), or a ready 4-D mask.
    """
    if not 1 <= query_length <= key_length:
        raise ValueError(
            f"self-attention needs 1 <= query_length <= key_length (keys = cached + new tokens); got "
            f"query_length={query_length}, key_length={key_length}"
        )
    if sliding_window is not None and (not causal or isinstance(sliding_window, bool) or sliding_window < 1):
        raise ValueError(
            f"sliding_window={sliding_window!r}: a sliding window must be a positive int and applies to causal "
            f"self-attention only (causal={causal})"
        )
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = ready_4d_mask(attention_mask, query_length=query_length, key_length=key_length)
        if mask.shape[0] not in (1, batch_size):
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} does not match batch_size={batch_size}"
            )
        return AttentionMask(mask, causal)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be 2-D [batch, key_length] or 4-D [batch, 1, query, key]; got shape "
            f"{tuple(attention_mask.shape)}"
        )
    if attention_mask is not None:
        _check_2d_mask(attention_mask, batch_size=batch_size, key_length=key_length, field="attention_mask")
    padded = attention_mask is not None and _has_padding(attention_mask)
    windowed = causal and sliding_window is not None and key_length > sliding_window
    if not padded and not windowed and (not causal or query_length in (1, key_length)):
        return AttentionMask(None, causal and query_length > 1)

    mask = torch.ones(query_length, key_length, dtype=torch.bool, device=device)
    if causal:
        mask = causal_bool_mask(query_length, key_length, device)
        if windowed:
            # Query i (absolute position i + Sk - Sq) sees the last `sliding_window` keys up to itself.
            rows = torch.arange(query_length, device=device)[:, None] + (key_length - query_length)
            cols = torch.arange(key_length, device=device)[None, :]
            mask = mask & (rows - cols < sliding_window)
    mask = mask[None, None].expand(batch_size, 1, query_length, key_length)
    if padded:
        key_valid = attention_mask.to(device=device, dtype=torch.bool)
        mask = mask & key_valid[:, None, None, :]
        if causal:
            query_valid = key_valid[:, key_length - query_length :]
            mask = mask & query_valid[:, None, :, None]
    return AttentionMask(mask, causal)


def cross_attention_mask(
    encoder_attention_mask: Optional[torch.Tensor], *, query_length: int
) -> AttentionMask:
    """Decoder queries over encoder keys: only the encoder's padding is masked."""
    if encoder_attention_mask is None:
        return AttentionMask(None, False)
    if encoder_attention_mask.dim() == 4:
        key_length = encoder_attention_mask.shape[-1]
        return AttentionMask(
            ready_4d_mask(encoder_attention_mask, query_length=query_length, key_length=key_length), False
        )
    if encoder_attention_mask.dim() != 2:
        raise ValueError(
            f"encoder_attention_mask must be 2-D [batch, encoder_length]; got shape "
            f"{tuple(encoder_attention_mask.shape)}"
        )
    if not _has_padding(encoder_attention_mask):
        return AttentionMask(None, False)
    batch, key_length = encoder_attention_mask.shape
    mask = encoder_attention_mask.to(torch.bool)[:, None, None, :].expand(batch, 1, query_length, key_length)
    return AttentionMask(mask, False)


def _broadcasts(*shapes) -> bool:
    try:
        torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return False
    return True


def with_position_bias(mask: AttentionMask, bias: torch.Tensor, dtype: torch.dtype) -> AttentionMask:
    """Folds an additive position bias (T5 relative buckets, [1|B, H, Sq, Sk]) and the mask into one float mask."""
    if bias.dim() != 4 or (
        mask.mask is not None and not _broadcasts(mask.mask.shape, bias.shape)
    ):
        mask_shape = None if mask.mask is None else tuple(mask.mask.shape)
        raise ValueError(
            f"position bias of shape {tuple(bias.shape)} must be [1 or batch, heads, query, key] and match the "
            f"mask of shape {mask_shape}"
        )
    bias = bias.to(dtype)
    if mask.mask is None and mask.is_causal:
        sq, sk = bias.shape[-2:]
        mask = AttentionMask(causal_bool_mask(sq, sk, bias.device)[None, None], True)
    if mask.mask is None:
        return AttentionMask(bias, mask.is_causal)
    lowest = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=bias.device)
    return AttentionMask(torch.where(mask.mask, bias, lowest), mask.is_causal)

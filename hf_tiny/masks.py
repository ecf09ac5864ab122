"""Attention masks in one representation: a bool tensor [B, 1, Sq, Sk], True = attend, plus an `is_causal` flag.

A mask is None when nothing needs masking beyond plain causality (no padding, Sq == Sk or a single new query):
then backends take their fast path (SDPA's causal kernel, flash without varlen) instead of reading a 4-D tensor.

Packed (padding-free) rows hold several sequences one after the other, as `DataCollatorWithFlattening` builds
them: `position_ids` restart at 0 where a sequence begins (or `cu_seq_lens_q/k` give the boundaries). Their mask
is block-diagonal and causal, and `segment_ids` ([B, S], the index of each token's sequence within its row) travel
with it so that kernels which take sequence boundaries instead of a mask (flash varlen) can read them.

Padding rules (the same in every family):
- keys that are padding are never attended to;
- in causal self-attention, padding queries are fully masked too, so they give zeros in every backend
  (their outputs are never used: generation reads the last position, losses ignore padded labels).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .attention import causal_bool_mask
from .validation import is_compiling


class AttentionMask(NamedTuple):
    mask: Optional[torch.Tensor]
    is_causal: bool
    segment_ids: Optional[torch.Tensor] = None  # packed rows only: [B, S] sequence index of each token


def _has_padding(attention_mask: torch.Tensor) -> bool:
    # A data-dependent check; under torch.compile we always build the mask instead of branching on data.
    return is_compiling() or not bool(attention_mask.all())


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
        if not is_compiling():
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


# ----------------------------------------------------------------------------------------------------------------
# Packed (padding-free) rows
# ----------------------------------------------------------------------------------------------------------------


def segment_ids_from_position_ids(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """[B, S] index of the sequence each token belongs to, where a sequence starts wherever position ids do not
    continue by +1 (transformers' `find_packed_sequence_indices` rule); None when every row holds one sequence.
    Under torch.compile the ids are always returned (no data-dependent branch)."""
    first = position_ids[:, :1] - 1
    segment_ids = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    if not is_compiling() and not bool(segment_ids[:, -1].any()):
        return None
    return segment_ids


def segment_ids_from_cu_seq_lens(
    cu_seq_lens: torch.Tensor, *, batch_size: int, length: int, field: str = "cu_seq_lens_q"
) -> torch.Tensor:
    """[1, S] sequence index of each token from cumulative sequence lengths [0, l0, l0 + l1, ..., S] (the flash
    varlen convention that `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` produces)."""
    if not isinstance(cu_seq_lens, torch.Tensor) or cu_seq_lens.dim() != 1 or cu_seq_lens.is_floating_point():
        shape = tuple(cu_seq_lens.shape) if isinstance(cu_seq_lens, torch.Tensor) else type(cu_seq_lens).__name__
        raise ValueError(f"{field} must be a 1-D integer tensor [0, len0, len0 + len1, ...], got {shape}")
    if batch_size != 1:
        raise ValueError(
            f"{field} describes sequences packed into one row; the input has batch_size={batch_size} (expected 1)"
        )
    if not is_compiling():
        values = cu_seq_lens.tolist()
        if len(values) < 2 or values[0] != 0 or values[-1] != length or any(b <= a for a, b in zip(values, values[1:])):
            raise ValueError(
                f"{field}={values} must start at 0, increase strictly and end at the packed length {length}"
            )
    token = torch.arange(length, device=cu_seq_lens.device)
    return (torch.searchsorted(cu_seq_lens[1:-1].to(token.dtype), token, right=True))[None, :]


def packed_causal_mask(segment_ids: torch.Tensor, *, sliding_window: Optional[int] = None) -> AttentionMask:
    """Causal attention inside each packed sequence and none across them: bool [B, 1, S, S]."""
    seq = segment_ids.shape[-1]
    mask = causal_bool_mask(seq, seq, segment_ids.device)
    if sliding_window is not None:
        rows = torch.arange(seq, device=segment_ids.device)[:, None]
        mask = mask & (rows - torch.arange(seq, device=segment_ids.device)[None, :] < sliding_window)
    same_sequence = segment_ids[:, :, None] == segment_ids[:, None, :]
    return AttentionMask((mask[None] & same_sequence)[:, None], True, segment_ids)


def static_cache_mask(
    attention_mask: Optional[torch.Tensor],
    past_length,
    key_offset,
    key_length: int,
    batch_size: int,
    query_length: int,
    window: Optional[int],
    device: torch.device,
) -> AttentionMask:
    """Causal bool mask [B, 1, Sq, key_length] for caches whose keys are not simply the last keys (static caches).

    Key slot j holds absolute position key_offset + j; query i sits at absolute position past_length + i. Slots
    not filled yet lie after the newest position, so causality masks them. Written with tensor ops only
    (past_length may be a 0-d tensor), so it compiles without graph breaks.
    """
    query_pos = (torch.arange(query_length, device=device) + past_length)[:, None]
    key_pos = (torch.arange(key_length, device=device) + key_offset)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    mask = mask[None, None].expand(batch_size, 1, query_length, key_length)
    if attention_mask is not None:
        valid = attention_mask.to(device=device, dtype=torch.bool)
        known = valid.shape[-1]
        slot = key_pos[0].clamp(max=known - 1)
        key_valid = valid[:, slot] & (key_pos[0] < known)[None, :]
        query_valid = valid[:, (query_pos[:, 0]).clamp(max=known - 1)]
        mask = mask & key_valid[:, None, None, :] & query_valid[:, None, :, None]
    return AttentionMask(mask, True)

"""Attention masks, each with its layout declared: built once per forward, read by every layer of one type.

A mask is an `AttentionMask(mask, is_causal, layout, hidden_rows)`. `mask` is what naive and SDPA kernels apply: None (plain
causality or nothing to mask, so that kernels take their fast path), a bool tensor [B, 1, Sq, Sk] (True = attend),
or a float tensor holding an additive bias (T5's relative buckets, ALiBi) with masked entries at the dtype's lowest
value. `layout` (a MaskLayout) says what the tensor holds — the padding of each row, causality, a sliding window,
chunks, packed sequences — for the kernels that take sequence boundaries instead of masks (flash varlen, flash.py).
The function that builds a mask states its layout; no code reads a layout back out of a tensor. A mask that comes
from outside (a caller's 4-D mask) has none: flash kernels refuse it, naming the backends that take any pattern.
`hidden_rows`, the query rows that see no key, is derived once per forward for the kernels that apply the mask
(with_hidden_rows).

Padding rules, the same in every family and every backend: keys that are padding are never attended to; queries
are never masked for being padding. A padded query therefore sees the real tokens before it (right padding), as in
official transformers' eager and sdpa; a query that sees no key at all (left padding's pad positions in causal
attention) gives zeros, where official's kernels give the average of the values they were handed. Flash kernels
compute the real queries only (a padded query of causal attention gives zeros there, as in official
flash_attention_2). Packed (padding-free) rows hold several sequences one after the other: position_ids restarting
at 0, or cu_seq_lens_q/k, give the boundaries, and no token attends across them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional

import torch
from transformers.cache_utils import Cache

is_compiling = torch.compiler.is_compiling


def causal_bool_mask(query_length: int, key_length: int, device: torch.device, window: Optional[int] = None) -> torch.Tensor:
    """[Sq, Sk] bool, True where query i (at key position i + Sk - Sq: bottom-right aligned) may see key j: keys at
    or before it, with a window only the last `window` of them."""
    distance = torch.arange(query_length, device=device)[:, None] + (key_length - query_length)
    distance = distance - torch.arange(key_length, device=device)[None, :]
    return distance >= 0 if window is None else (distance >= 0) & (distance < window)


def visible_rows(mask: torch.Tensor) -> torch.Tensor:
    """Bool [..., Sq, 1]: True where the query row sees at least one key."""
    if mask.dtype == torch.bool:
        return mask.any(dim=-1, keepdim=True)
    return (mask > torch.finfo(mask.dtype).min / 2).any(dim=-1, keepdim=True)


class ChunkLayout(NamedTuple):
    """Chunked attention (Llama 4): a query sees only the keys of its own chunk of `size` positions, chunks counted
    from `first` [B | 1], each row's first real position; query_positions [Sq] and key_positions [Sk] are the
    absolute positions of the queries and of the keys."""

    size: int
    first: torch.Tensor
    query_positions: torch.Tensor
    key_positions: torch.Tensor


@dataclass(frozen=True, eq=False)
class MaskLayout:
    """What a bool mask [B, 1, Sq, Sk] holds, declared by the function that built it.

    key_valid: [B, Sk] bool, the real keys (None: every key is real). causal: query i is the key at index
    query_offset + i (None: Sk - Sq, bottom-right, as after a dynamic cache) and sees the keys up to it; keys after
    the last query's own (a static cache's empty slots) are never seen. window: causal, a query sees the last
    `window` keys up to itself; not causal, the keys at most `window` positions before or after it (ModernBERT).
    chunks: causal attention within chunks. segment_ids: [B, S] packed rows, each run of equal ids one causal
    sequence (cut at chunks already). memo: what a kernel derives from the layout, derived once per forward and
    shared by every layer the mask serves (flash's varlen indices)."""

    query_length: int
    key_length: int
    causal: bool
    key_valid: Optional[torch.Tensor] = None
    query_offset: object = None  # int, or a 0-d tensor under torch.compile
    window: Optional[int] = None
    chunks: Optional[ChunkLayout] = None
    segment_ids: Optional[torch.Tensor] = None
    memo: dict = field(default_factory=dict, repr=False)


class AttentionMask(NamedTuple):
    mask: Optional[torch.Tensor]
    is_causal: bool
    layout: Optional[MaskLayout] = None  # None with a mask: a mask from outside, whose layout nobody declared
    # [B | 1, 1, Sq, 1] bool, True where a query row sees no key, whose output the kernels zero; set (with_hidden_rows),
    # `mask` lets those rows see every key, so that no kernel meets a fully masked row. None: each call derives them
    hidden_rows: Optional[torch.Tensor] = None


def with_hidden_rows(mask: AttentionMask) -> AttentionMask:
    """The mask as the kernels that apply it take it (a row that sees no key sees every key) and those rows, derived
    once for every layer the mask serves rather than by each layer."""
    if mask.mask is None or mask.hidden_rows is not None:
        return mask
    hidden = ~visible_rows(mask.mask)
    return mask._replace(mask=unhidden(mask.mask, hidden), hidden_rows=hidden)


def unhidden(mask: torch.Tensor, hidden: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`mask` (bool, or an additive bias clamped to `dtype`'s range) with the `hidden` rows seeing every key."""
    if mask.dtype == torch.bool:
        return mask | hidden
    dtype = dtype or mask.dtype
    return torch.where(hidden, 0.0, mask.to(dtype).clamp(min=torch.finfo(dtype).min)).to(dtype)


# ---- self-attention and cross-attention ------------------------------------------------------------------------

# An additive mask value at or below this is "masked": exp(-1e4) is 0 in every dtype (the oldest convention,
# BERT's -10000.0, and finfo.min both qualify). Values between it and 0 are biases, which a bool mask cannot hold.
_MASKED_AT_OR_BELOW = -1e4


def ready_4d_mask(attention_mask: torch.Tensor, *, query_length: int, key_length: int,
                  one_row_for_all_queries: bool = False) -> torch.Tensor:
    """A caller's 4-D mask: bool (True = attend) as it is, float additive (0 = attend, large negative = masked,
    e.g. transformers' eager masks) as a bool, integer 1/0 as a bool. one_row_for_all_queries (attention without
    causality): a [batch, 1, 1, keys] mask, the extended mask of BERT-era code (get_extended_attention_mask), is
    taken for every query, as official encoders broadcast it."""
    rows = (query_length, 1) if one_row_for_all_queries else (query_length,)
    if attention_mask.dim() != 4 or attention_mask.shape[-1] != key_length or attention_mask.shape[-2] not in rows:
        broadcast = f" or [batch, 1, 1, {key_length}]" if one_row_for_all_queries else ""
        expected = f"[batch, 1, {query_length}, {key_length}]{broadcast}"
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)} does not match {query_length} queries and "
            f"{key_length} keys; expected {expected}"
        )
    if attention_mask.shape[-2] != query_length:
        attention_mask = attention_mask.expand(*attention_mask.shape[:2], query_length, key_length)
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


def self_attention_mask(attention_mask, *, batch_size: int, query_length: int, key_length: int, causal: bool,
                        sliding_window: Optional[int] = None, device: torch.device) -> AttentionMask:
    """Self-attention of query_length new tokens over key_length keys (cached + new), aligned bottom-right;
    attention_mask None, 2-D [B, key_length] 1/0, or a ready 4-D mask; a query sees the last sliding_window keys."""
    _check_self_attention(attention_mask, batch_size, query_length, key_length, causal, sliding_window)
    if attention_mask is not None and attention_mask.dim() == 4:
        ready = ready_4d_mask(attention_mask, query_length=query_length, key_length=key_length,
                              one_row_for_all_queries=not causal)
        return AttentionMask(ready, causal)
    return _self_attention(attention_mask, batch_size, query_length, key_length, causal, sliding_window, device)


def _self_attention(attention_mask, batch_size: int, query_length: int, key_length: int, causal: bool,
                    sliding_window: Optional[int], device) -> AttentionMask:
    """self_attention_mask for checked arguments and a 2-D mask or none."""
    # under torch.compile / export the padding mask and the window are always applied: no branch on the data or
    # on a length that may be symbolic (a window wider than the keys restricts nothing)
    padded = attention_mask is not None and (is_compiling() or not bool(attention_mask.all()))
    windowed = causal and sliding_window is not None and (is_compiling() or key_length > sliding_window)
    window = sliding_window if windowed else None
    if not padded and window is None and (not causal or query_length in (1, key_length)):
        return AttentionMask(None, causal and query_length > 1)
    if causal:
        mask = causal_bool_mask(query_length, key_length, device, window=window)
    else:
        mask = torch.ones(query_length, key_length, dtype=torch.bool, device=device)
    mask = mask[None, None].expand(batch_size, 1, query_length, key_length)
    key_valid = attention_mask.to(device=device, dtype=torch.bool) if padded else None
    if padded:
        mask = mask & key_valid[:, None, None, :]
    return AttentionMask(mask, causal, MaskLayout(query_length, key_length, causal, key_valid, window=window))


def encoder_masks(config, attention_mask, *, batch_size: int, length: int, device: torch.device) -> dict:
    """{layer type: AttentionMask} of a bidirectional encoder's layers, built once per forward: full attention over
    the real tokens, and for sliding layers (ModernBERT's local attention) only the keys at most
    config.sliding_window positions before or after the query (transformers' bidirectional sliding window). A 4-D
    attention_mask is the caller's whole mask, for every layer type, as official masks take it."""
    full = self_attention_mask(attention_mask, batch_size=batch_size, query_length=length, key_length=length,
                               causal=False, device=device)
    masks = {"full_attention": full}
    if "sliding_attention" in config.attention_types():
        given = attention_mask is not None and attention_mask.dim() == 4
        masks["sliding_attention"] = full if given else _within_reach(full, config.sliding_window, batch_size, length, device)
    return masks


def _within_reach(mask: AttentionMask, reach: int, batch_size: int, length: int, device) -> AttentionMask:
    """The bidirectional mask `mask` (built from a 2-D mask or none) limited to keys at most `reach` positions from
    the query."""
    if length <= reach + 1 and not is_compiling():  # every key is within reach
        return mask
    positions = torch.arange(length, device=device)
    near = (positions[:, None] - positions[None, :]).abs() <= reach
    if mask.mask is None:
        return AttentionMask(near[None, None].expand(batch_size, 1, length, length), False,
                             MaskLayout(length, length, False, window=reach))
    return AttentionMask(mask.mask & near, False, replace(mask.layout, window=reach, memo={}))


def _check_self_attention(attention_mask, batch_size, query_length, key_length, causal, sliding_window) -> None:
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
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[0] not in (1, batch_size):
        raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} does not match batch_size={batch_size}")
    if attention_mask is not None and attention_mask.dim() not in (2, 4):
        raise ValueError(
            f"attention_mask must be 2-D [batch, key_length] or 4-D [batch, 1, query, key]; got shape "
            f"{tuple(attention_mask.shape)}"
        )
    if attention_mask is not None and attention_mask.dim() == 2 and tuple(attention_mask.shape) != (batch_size, key_length):
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)} does not match batch_size={batch_size} and "
            f"key_length={key_length} (cached + new tokens); expected [{batch_size}, {key_length}]"
        )


def cross_attention_mask(encoder_attention_mask, *, query_length: int) -> AttentionMask:
    """Decoder queries over encoder keys: only the encoder's padding is masked."""
    if encoder_attention_mask is None:
        return AttentionMask(None, False)
    if encoder_attention_mask.dim() == 4:
        key_length = encoder_attention_mask.shape[-1]
        ready = ready_4d_mask(encoder_attention_mask, query_length=query_length, key_length=key_length,
                              one_row_for_all_queries=True)
        return AttentionMask(ready, False)
    if encoder_attention_mask.dim() != 2:
        raise ValueError(
            f"encoder_attention_mask must be 2-D [batch, encoder_length]; got shape {tuple(encoder_attention_mask.shape)}"
        )
    if not is_compiling() and bool(encoder_attention_mask.all()):  # no padding (compiled: always the mask)
        return AttentionMask(None, False)
    batch, key_length = encoder_attention_mask.shape
    key_valid = encoder_attention_mask.to(torch.bool)
    return AttentionMask(key_valid[:, None, None, :].expand(batch, 1, query_length, key_length), False,
                         MaskLayout(query_length, key_length, False, key_valid))


# ---- additive position biases: T5's relative buckets, ALiBi ------------------------------------------------------


def _broadcasts(*shapes) -> bool:
    try:
        torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return False
    return True


def with_position_bias(mask: AttentionMask, bias: torch.Tensor, dtype: torch.dtype) -> AttentionMask:
    """Folds an additive position bias (T5 relative buckets, ALiBi; [1|B, H, Sq, Sk]) and the mask into one float
    mask. Its layout is none: no flash kernel adds a bias."""
    if bias.dim() != 4 or (mask.mask is not None and not _broadcasts(mask.mask.shape, bias.shape)):
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


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """ALiBi (Press et al. 2022): [num_heads] float32 slopes as BLOOM and MPT compute them: for n heads with p = the
    largest power of two <= n, the geometric sequence m_k = 2^(-max_bias * k / p), k = 1 .. p, then (n > p) the
    n - p slopes halfway between those, 2^(-max_bias * (2k - 1) / (2p)), k = 1 .. n - p."""
    power = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-max_bias * k / power) for k in range(1, power + 1)]
    slopes += [2.0 ** (-max_bias * (2 * k - 1) / (2 * power)) for k in range(1, num_heads - power + 1)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """[1, H, Sq, Sk] bias -m_h * (query position - key position), in float32 (masked entries are set by the mask)."""
    distance = (query_positions[:, None] - key_positions[None, :]).to(torch.float32)
    return -(slopes.to(distance.device)[:, None, None] * distance)[None]


def refuse_alibi(config, where: str) -> None:
    if config.position_embedding_type == "alibi":
        raise ValueError(
            f"ALiBi adds a distance bias to the attention scores through the mask, which {where} does not take; use "
            "attn_implementation='sdpa' or 'eager'"
        )


def refuse_chunked_layers(config, where: str) -> None:
    """Llama 4's chunked layers keep each token inside its chunk through the mask alone: without one they would
    attend over everything, silently."""
    if "chunked_attention" in config.layer_types:
        raise ValueError(
            f"chunked attention (attention_chunk_size={config.chunked_attention.attention_chunk_size}) keeps each "
            f"token inside its chunk through the mask, which {where} does not take (it would attend over every "
            "token); use attn_implementation='sdpa' or 'eager'"
        )


# ---- packed rows ---------------------------------------------------------------------------------------------------


def segment_ids_from_position_ids(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """[B, S] index of the sequence each token belongs to, where a sequence starts wherever position ids do not
    continue by +1 (transformers' `find_packed_sequence_indices` rule); None when every row holds one sequence.
    Under torch.compile the ids are always returned (no data-dependent branch)."""
    first = position_ids[:, :1] - 1
    segment_ids = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    if not is_compiling() and not bool(segment_ids[:, -1].any()):
        return None
    return segment_ids


def _split_at_chunks(segment_ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, S] segment ids split further at every chunk_size-th token of each segment."""
    index = torch.arange(segment_ids.shape[-1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    segment_start = torch.where(starts, index, 0).cummax(-1).values
    chunk_starts = starts | ((index - segment_start) % chunk_size == 0)
    return chunk_starts.long().cumsum(-1) - 1


def segment_ids_from_cu_seq_lens(cu_seq_lens, *, batch_size: int, length: int, field: str = "cu_seq_lens_q") -> torch.Tensor:
    """[1, S] sequence index of each token from cumulative sequence lengths [0, l0, l0 + l1, ..., S] (the flash
    varlen convention that `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` produces)."""
    if not isinstance(cu_seq_lens, torch.Tensor) or cu_seq_lens.dim() != 1 or cu_seq_lens.is_floating_point():
        shape = tuple(cu_seq_lens.shape) if isinstance(cu_seq_lens, torch.Tensor) else type(cu_seq_lens).__name__
        raise ValueError(f"{field} must be a 1-D integer tensor [0, len0, len0 + len1, ...], got {shape}")
    if batch_size != 1:
        raise ValueError(f"{field} describes sequences packed into one row; the input has batch_size={batch_size} (expected 1)")
    if not is_compiling():
        values = cu_seq_lens.tolist()
        if len(values) < 2 or values[0] != 0 or values[-1] != length or any(b <= a for a, b in zip(values, values[1:])):
            raise ValueError(f"{field}={values} must start at 0, increase strictly and end at the packed length {length}")
    token = torch.arange(length, device=cu_seq_lens.device)
    return (torch.searchsorted(cu_seq_lens[1:-1].to(token.dtype), token, right=True))[None, :]


def segment_ids_from_seq_idx(seq_idx, *, batch_size: int, length: int) -> torch.Tensor:
    """[B, S] sequence index of each token as TRL's padding-free collator gives it (seq_idx, one row of int32)."""
    if not isinstance(seq_idx, torch.Tensor) or seq_idx.is_floating_point() or seq_idx.dim() != 2 or (
        seq_idx.shape[-1] != length or seq_idx.shape[0] not in (1, batch_size)
    ):
        shape = tuple(seq_idx.shape) if isinstance(seq_idx, torch.Tensor) else type(seq_idx).__name__
        raise ValueError(f"seq_idx must be an integer tensor of shape ({batch_size}, {length}) (each token's sequence "
                         f"index), got {shape}")
    return seq_idx.expand(batch_size, -1)


def packed_causal_mask(segment_ids: torch.Tensor, *, sliding_window: Optional[int] = None,
                       chunk_size: Optional[int] = None) -> AttentionMask:
    """Causal attention inside each packed sequence and none across them: bool [B, 1, S, S]. With chunk_size each
    sequence's chunks (of its own positions 0, 1, ..) attend as sequences of their own, and are segments of their
    own in the layout."""
    if chunk_size is not None:
        segment_ids = _split_at_chunks(segment_ids, chunk_size)
    seq = segment_ids.shape[-1]
    mask = causal_bool_mask(seq, seq, segment_ids.device)
    if sliding_window is not None:
        rows = torch.arange(seq, device=segment_ids.device)[:, None]
        mask = mask & (rows - torch.arange(seq, device=segment_ids.device)[None, :] < sliding_window)
    same_sequence = segment_ids[:, :, None] == segment_ids[:, None, :]
    layout = MaskLayout(seq, seq, True, window=sliding_window, segment_ids=segment_ids)
    return AttentionMask((mask[None] & same_sequence)[:, None], True, layout)


# ---- the masks of a causal forward: per layer type, after the cache update -----------------------------------------


@dataclass(frozen=True)
class CausalShape:
    batch_size: int
    query_length: int
    past_length: object  # int, or a 0-d tensor under torch.compile
    device: torch.device


def key_layout(cache: Optional[Cache], shape: CausalShape, layer_idx: int):
    """(key_length, key_offset): the keys layer `layer_idx` attends to after its cache update are the absolute
    positions key_offset .. key_offset + key_length - 1 (a static cache also holds unfilled slots, a sliding layer's
    cache only the last window)."""
    if cache is None:
        return shape.past_length + shape.query_length, 0
    return cache.get_mask_sizes(shape.query_length, layer_idx)


def _last_columns(attention_mask: torch.Tensor, width: int) -> torch.Tensor:
    """The 2-D padding mask's last `width` columns; a narrower mask is filled on the left with padding (0)."""
    known = attention_mask.shape[-1]
    if known >= width:
        return attention_mask[:, known - width :]
    return torch.nn.functional.pad(attention_mask, (width - known, 0), value=0)


def causal_mask(attention_mask, cache, shape: CausalShape, window: Optional[int], *, layer_idx: int) -> AttentionMask:
    """The mask of the layers of one type: `window` is their sliding window (None: full causal), `layer_idx` the
    first such layer (its cache tells which keys they hold).

    A 2-D padding mask's column c is position c, as transformers reads it, when it covers every position: the
    forward's attention_mask, or with a static cache one wider than the tokens (generate's, at the cache's length:
    columns after the newest token are empty slots, not read). One narrower than the tokens holds the last columns,
    those the layer's keys reach (transformers' per-layer-type masks for flash attention: flash_attention_mask slices
    them); keys before its first column are not attended."""
    key_length, key_offset = key_layout(cache, shape, layer_idx)
    if attention_mask is not None and attention_mask.dim() == 4:
        return self_attention_mask(attention_mask, batch_size=shape.batch_size, query_length=shape.query_length,
                                   key_length=key_length, causal=True, device=shape.device)
    if cache is None or not cache.is_compileable:
        # Dynamic caches return exactly the keys at positions key_offset .. past + new - 1: causality is bottom-right
        # aligned and the padding mask's last key_length columns belong to them.
        if attention_mask is not None:
            attention_mask = _last_columns(attention_mask, key_length)
        return _self_attention(attention_mask, shape.batch_size, shape.query_length, key_length, True, window, shape.device)
    return static_cache_mask(attention_mask, shape.past_length, key_offset, key_length, shape.batch_size,
                             shape.query_length, window, shape.device)


def static_cache_mask(attention_mask, past_length, key_offset, key_length: int, batch_size: int, query_length: int,
                      window: Optional[int], device: torch.device) -> AttentionMask:
    """Causal bool mask [B, 1, Sq, key_length] for caches whose keys are not simply the last keys (static caches).
    Key slot j holds absolute position key_offset + j; query i sits at absolute position past_length + i. Slots not
    filled yet lie after the newest position, so causality masks them. The 2-D attention_mask's columns are read as
    causal_mask says. Tensor ops only (past_length may be a 0-d tensor), so it compiles without graph
    breaks."""
    query_pos = (torch.arange(query_length, device=device) + past_length)[:, None]
    key_pos = (torch.arange(key_length, device=device) + key_offset)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    mask = mask[None, None].expand(batch_size, 1, query_length, key_length)
    key_valid = None
    if attention_mask is not None:
        valid = attention_mask.to(device=device, dtype=torch.bool)
        known = valid.shape[-1]
        narrower_by = past_length + query_length - known  # > 0: it holds the last tokens; else it starts at position 0
        shift = narrower_by.clamp(min=0) if isinstance(narrower_by, torch.Tensor) else max(narrower_by, 0)
        column = key_pos[0] - shift
        inside = (column >= 0) & (column < known)
        key_valid = valid[:, column.clamp(min=0, max=known - 1)] & inside[None, :]
        mask = mask & key_valid[:, None, None, :]
    layout = MaskLayout(query_length, key_length, True, key_valid, query_offset=past_length - key_offset, window=window)
    return AttentionMask(mask, True, layout)


def chunked_layer_mask(mask: AttentionMask, attention_mask, cache, shape: CausalShape, chunk_size: int,
                       layer_idx: int) -> AttentionMask:
    """The causal mask of chunked-attention layers: the new queries at past_length .. and the keys where the
    layer's cache holds them (a chunked layer's cache keeps the last chunk_size - 1 keys, as a sliding one)."""
    key_length, key_offset = key_layout(cache, shape, layer_idx)
    queries = torch.arange(shape.query_length, device=shape.device) + shape.past_length
    keys = torch.arange(key_length, device=shape.device) + key_offset
    return within_chunks(mask, attention_mask, queries, keys, chunk_size)


def within_chunks(mask: AttentionMask, attention_mask, queries: torch.Tensor, keys: torch.Tensor,
                  chunk_size: int) -> AttentionMask:
    """Chunked attention (Llama 4): the causal `mask` of queries at positions `queries` [Sq] over keys at `keys`
    [Sk], restricted to the keys of each query's own chunk of chunk_size positions. Chunks count from each row's
    first real token (the 2-D attention_mask's leading padding skipped), as transformers' chunked_overlay."""
    if attention_mask is None:
        first = torch.zeros(1, dtype=torch.long, device=queries.device)
    else:
        first = (attention_mask.cumsum(-1) == 0).sum(-1).to(queries.device)  # [B] leading padding tokens
    query_chunk = (queries[None, :] - first[:, None]).div(chunk_size, rounding_mode="floor")
    key_chunk = (keys[None, :] - first[:, None]).div(chunk_size, rounding_mode="floor")
    same_chunk = query_chunk[:, :, None] == key_chunk[:, None, :]  # [B | 1, Sq, Sk]
    if not is_compiling() and bool(same_chunk.all()):
        return mask  # every key lies in its query's chunk: nothing to restrict (and the fast path stays)
    sq, sk = len(queries), len(keys)
    base, layout = mask.mask, mask.layout
    if base is None:
        base = causal_bool_mask(sq, sk, queries.device) if mask.is_causal else torch.ones(sq, sk, dtype=torch.bool, device=queries.device)
        layout = MaskLayout(sq, sk, mask.is_causal)
    if layout is not None:
        layout = replace(layout, chunks=ChunkLayout(chunk_size, first, queries, keys), memo={})
    return AttentionMask(base & same_chunk[:, None], mask.is_causal, layout)


def alibi_mask(config, mask: AttentionMask, cache, shape: CausalShape, layer_type: str, dtype) -> AttentionMask:
    """The layer type's mask with ALiBi's distance bias folded in (queries at past_length .., keys where the cache
    holds them after the update)."""
    key_length, key_offset = key_layout(cache, shape, config.layer_types.index(layer_type))
    queries = torch.arange(shape.query_length, device=shape.device) + shape.past_length
    keys = torch.arange(key_length, device=shape.device) + key_offset
    slopes = alibi_slopes(config.num_attention_heads, config.alibi_bias.alibi_bias_max)
    return with_position_bias(mask, alibi_bias(slopes, queries, keys), dtype)

"""Attention backends: the math of softmax(Q Kᵀ · scale + M) V, and nothing else.

Every backend has the same signature and never sees a config or a module, so they can be tested against each
other in isolation:

    fn(q, k, v, mask=None, *, scale, dropout_p=0.0, is_causal=False, output_attentions=False, segment_ids=None,
       sinks=None) -> (out [B, H, Sq, D], weights [B, H, Sq, Sk] or None)

q is [B, H, Sq, D]; k and v are [B, Hkv, Sk, D] with H a multiple of Hkv (GQA / MQA). ATTENTION_BACKENDS /
get_attention_backend(name) check these shapes before the math; attention modules, whose projections make them
so, call the math directly.
mask is None, a bool tensor (True = attend) or a float additive tensor, broadcastable to [B, H, Sq, Sk]. A given
mask is complete (causality already inside it). `is_causal` says whether the attention is causal: with no mask
the backend applies it, aligned bottom-right (query i sees keys j <= i + Sk - Sq, the rule for decoding after a
KV cache); with a mask, naive and sdpa ignore it and flash reads causality from the mask itself (trying the
`is_causal` reading first) to choose its kernels.
A query row with no visible key returns zeros, never NaN, in every backend.
segment_ids ([B, S], packed rows of self-attention only) names the sequence of each token; the mask already
holds the same boundaries, so naive and sdpa ignore it, while flash runs each sequence as its own varlen slice.
sinks ([H], GPT-OSS's attention sinks, transformers' `s_aux`) is one more logit per head in every query's softmax
denominator, attached to no value: softmax([Q Kᵀ · scale + M, sinks[h]]) without its last column, so a row's weights
sum to less than 1 (a row that sees no key gives zeros here too). Naive appends the column, our Triton kernel starts
its online softmax from it, and the kernels without a sink argument (SDPA, PyTorch's flash) see it as one more key
(sink_as_first_key).

Names follow Hugging Face habits: "eager" is the naive formula, "sdpa" is torch's
scaled_dot_product_attention, "flash_attention_2" runs FlashAttention kernels (the flash-attn package on CUDA when
installed, else our Triton kernel on CUDA and PyTorch's FLASH_ATTENTION SDPA kernel on CPU); "hf_tiny_flash" is our
Triton kernel by name (hf_tiny/flash_triton.py: CUDA, or CPU under Triton's interpreter).

Models call them the way transformers' models call attention, through the attention interface
(`ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)(module, q, k, v, mask, scaling=...)`,
output [B, S, H, D]): the end of this file wraps each backend in that convention and registers it, under its own
name, in an instance of transformers' AttentionInterface whose other names are transformers' (flex_attention,
paged|eager, hub kernels, vLLM's, a user's). What those other functions and engines need is engines.py's.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

BackendOutput = tuple[torch.Tensor, Optional[torch.Tensor]]


def repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * n_rep, S, D], each KV head shared by n_rep consecutive query heads."""
    if n_rep == 1:
        return hidden
    batch, kv_heads, seq, dim = hidden.shape
    hidden = hidden[:, :, None, :, :].expand(batch, kv_heads, n_rep, seq, dim)
    return hidden.reshape(batch, kv_heads * n_rep, seq, dim)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: Optional[torch.Tensor] = None) -> None:
    """Values may be narrower or wider than keys (MLA's v_head_dim) except in the flash kernels (_check_one_head_dim).
    sinks: one logit per query head."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D q, k, v [batch, heads, seq, head_dim]; got {shapes}")
    if k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k and v must have the same [batch, heads, seq] and q, k the same head_dim; got {shapes}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (q.shape[1],)):
        found = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"attention sinks (s_aux) hold one logit per query head, shape ({q.shape[1]},); got {found}")


def _check_one_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str) -> None:
    """The flash kernels take values of the queries' and keys' head_dim only."""
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"attn_implementation={backend!r} needs one head_dim for queries, keys and values; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (MLA's v_head_dim); use "
            "attn_implementation='sdpa' or 'eager'"
        )


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


def _score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and softmax of half-precision inputs run in fp32.

    Official eager computes QKᵀ in the input dtype: in fp16 it overflows to inf (then NaN) once |QKᵀ| passes
    65504 (e.g. head_dim 64 and activations ~40), and in bf16 every logit is rounded to 8 bits of mantissa.
    SDPA and flash kernels accumulate scores in fp32, so doing the same keeps the reference finite and closest to
    them. The softmax weights are cast back to the input dtype before · V, as in official eager.
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def softmax_with_sinks(scores: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax over the keys (last dimension of [B, H, Sq, Sk] scores); with attention sinks over the keys and one
    more logit per head, sinks[h], whose own weight is dropped (official GPT-OSS's eager attention)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def naive_attention(q, k, v, mask=None, *, scale: float, dropout_p: float = 0.0, is_causal: bool = False,
                    output_attentions: bool = False, segment_ids=None, sinks=None) -> BackendOutput:
    """softmax(Q Kᵀ · scale + M) V written out; the reference the other backends are tested against."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    score_dtype = _score_dtype(q.dtype)
    scores = torch.matmul(q.to(score_dtype), k.to(score_dtype).transpose(-2, -1)) * scale
    if mask is None and is_causal:
        mask = causal_bool_mask(q.shape[2], k.shape[2], q.device)
    if mask is not None:
        lowest = torch.finfo(scores.dtype).min
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, lowest)
        else:
            scores = (scores + mask.to(scores.dtype)).clamp(min=lowest)
    weights = softmax_with_sinks(scores, sinks).to(q.dtype)
    if mask is not None:
        weights = weights * visible_rows(mask).to(weights.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    out = torch.matmul(weights, v)
    return out, (weights if output_attentions else None)


def sink_as_first_key(q, k, v, mask, sinks: torch.Tensor, scale: float):
    """Attention sinks for kernels that take none (SDPA, PyTorch's flash kernel): the sink as one more key, first in
    line so that bottom-right causal masks keep it visible, seen by every query, with a zero value. Its score comes
    from extra head dimensions (zeros up to the next multiple of 8, which fast kernels want): in the first of them
    the queries of head h carry sinks[h] / scale and the sink key 1, so its score (q · k_sink) · scale is sinks[h]
    (exactly when scale is a power of two). Returns (q, k, v, mask) for the kernel; the caller drops the extra
    dimensions of the output."""
    batch, heads, sq, dim = q.shape
    extra = 8 - dim % 8
    # finite, so that the real keys' zeros in this dimension give 0 (a sink of -inf times 0 would give NaN)
    sink_scores = (sinks.to(q.dtype) / scale).clamp(min=torch.finfo(q.dtype).min)
    sink_scores = sink_scores[None, :, None, None].expand(batch, heads, sq, 1)
    q = F.pad(torch.cat([q, sink_scores], dim=-1), (0, extra - 1))
    sink_key = F.pad(k.new_ones(1), (dim, extra - 1)).expand(batch, k.shape[1], 1, dim + extra)
    k = torch.cat([sink_key, F.pad(k, (0, extra))], dim=2)
    v = F.pad(v, (0, extra, 1, 0))  # the sink's value (a first row of zeros), and the extra dimensions
    if mask is not None:
        seen = torch.ones((), dtype=torch.bool) if mask.dtype == torch.bool else torch.zeros((), dtype=mask.dtype)
        mask = torch.cat([seen.to(mask.device).expand(*mask.shape[:-1], 1), mask], dim=-1)
    return q, k, v, mask


def torch_attention(q, k, v, mask=None, *, scale: float, dropout_p: float = 0.0, is_causal: bool = False,
                    output_attentions: bool = False, segment_ids=None, sinks=None) -> BackendOutput:
    """torch's scaled_dot_product_attention (it picks the flash, memory-efficient or math kernel). A row that sees
    no key is handed to the kernel as seeing every key and zeroed after: some kernels return NaN for a fully masked
    row, forward and backward (CUDA memory-efficient, pytorch#110213). Sinks: sink_as_first_key."""
    _no_weights(output_attentions, "sdpa")
    value_dim, gqa = v.shape[-1], q.shape[1] != k.shape[1]
    if sinks is not None:
        q, k, v, mask = sink_as_first_key(q, k, v, mask, sinks, scale)
    sq, sk = q.shape[2], k.shape[2]
    if mask is None and is_causal and sq != sk:  # SDPA's is_causal is top-left aligned, ours bottom-right
        mask = None if sq == 1 else causal_bool_mask(sq, sk, q.device)
        is_causal = False
    visible = None if mask is None else visible_rows(mask)
    if mask is not None and mask.dtype == torch.bool:
        mask = mask | ~visible
    elif mask is not None:
        mask = torch.where(visible, mask.to(q.dtype).clamp(min=torch.finfo(q.dtype).min), 0.0).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                         is_causal=is_causal and mask is None, scale=scale, enable_gqa=gqa)
    out = out if visible is None else out.masked_fill(~visible, 0.0)
    return (out if sinks is None else out[..., :value_dim]), None


def _no_weights(output_attentions: bool, backend: str) -> None:
    if output_attentions:
        raise ValueError(
            f"output_attentions=True needs the attention weights, which the {backend!r} backend does not compute; "
            "use attn_implementation='eager'"
        )


FLASH_DTYPES = {"cuda": (torch.float16, torch.bfloat16), "cpu": (torch.float32, torch.float16, torch.bfloat16)}


def flash_attn_package_available(device: Optional[torch.device] = None) -> bool:
    """The flash-attn package (CUDA only) is used when installed and the tensors are on CUDA."""
    if device is not None and device.type != "cuda":
        return False
    return importlib.util.find_spec("flash_attn") is not None


def check_flash_can_run(device: torch.device, dtype: torch.dtype) -> None:
    """Flash kernels exist for CUDA tensors in fp16/bf16 and (PyTorch's) CPU tensors in fp32/fp16/bf16; anything
    else is a clear error, never a fallback."""
    if device.type not in FLASH_DTYPES:
        raise ValueError(
            f"attn_implementation='flash_attention_2' runs on CUDA or CPU tensors, got device '{device}'; "
            "use attn_implementation='sdpa' or 'eager' on this device"
        )
    if dtype not in FLASH_DTYPES[device.type]:
        names = " or ".join(str(t).removeprefix("torch.") for t in FLASH_DTYPES[device.type])
        raise ValueError(
            f"attn_implementation='flash_attention_2' runs in {names} on {device.type}, got dtype {dtype}; cast the "
            "model (model.to(torch.bfloat16)) or use attn_implementation='sdpa' or 'eager'"
        )


def _real_token_distance(query_valid: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """[B, Sq, Sk]: query position - key position counted over real tokens only, aligned bottom-right (the last
    real query sits at the last real key)."""
    q_pos = query_valid.long().cumsum(-1) + (key_valid.sum(-1, keepdim=True) - query_valid.sum(-1, keepdim=True))
    k_pos = key_valid.long().cumsum(-1)
    return q_pos[:, :, None] - k_pos[:, None, :]


def _causal_within_real_tokens(query_valid: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """[B, Sq, Sk]: causal among the real tokens only, aligned bottom-right (last real query sees last real key)."""
    return _real_token_distance(query_valid, key_valid) >= 0


def _padding_pattern(mask: torch.Tensor, q: torch.Tensor, sk: int, is_causal: bool):
    """Reads a bool mask as per-sequence padding: which queries and keys are real, and whether it is causal.

    Returns (query_valid [B, Sq], key_valid [B, Sk], causal). Flash kernels take only "real tokens + optional
    causal" patterns; any other mask (sliding windows, custom 4-D masks, additive biases) cannot be expressed and
    raises instead of computing something else. Causality is read from the mask itself (a given mask is
    complete); `is_causal` only says which reading to try first.
    """
    query_valid, key_valid, causal, _ = _read_mask(mask, q, sk, is_causal, allow_window=False)
    return query_valid, key_valid, causal


def _read_mask(mask: torch.Tensor, q: torch.Tensor, sk: int, is_causal: bool, *, allow_window: bool):
    """_padding_pattern, plus (allow_window: our Triton kernel) causal sliding windows: returns (query_valid,
    key_valid, causal, window), window None or the W of transformers' rule query - key < W over real tokens."""
    full = _mask_rows(mask, q, sk)
    key_valid = full.any(dim=1)  # [B, Sk]
    for causal in (True, False) if is_causal else (False, True):
        if causal and not _real_queries_see_keys(full, key_valid):
            continue
        query_valid = _valid_queries(full, key_valid, causal)
        padding_only = query_valid[:, :, None] & key_valid[:, None, :]
        distance = _real_token_distance(query_valid, key_valid)
        rebuilt = padding_only & (distance >= 0) if causal else padding_only
        window = int(full.sum(-1).max())  # the widest row sees exactly the window
        if not _dropped_rows_are_padding(full, key_valid, query_valid, window if allow_window else None):
            continue
        if torch.equal(rebuilt[query_valid], full[query_valid]):
            return query_valid, key_valid, causal, None
        if allow_window and causal and window > 0:
            if torch.equal((rebuilt & (distance < window))[query_valid], full[query_valid]):
                return query_valid, key_valid, True, window
    raise ValueError(
        "attn_implementation='flash_attention_2' supports padding and causal masks only; this mask (for "
        "example a sliding window or a custom 4-D mask) needs attn_implementation='sdpa' or 'eager'"
    )


def _mask_rows(mask: torch.Tensor, q: torch.Tensor, sk: int) -> torch.Tensor:
    """A bool mask as [B, Sq, Sk], the same for every head; other masks are clear errors."""
    if mask.dtype != torch.bool:
        raise ValueError(
            "attn_implementation='flash_attention_2' cannot apply an additive (float) attention mask or position "
            "bias; use attn_implementation='sdpa' or 'eager'"
        )
    batch, heads, sq = q.shape[:3]
    try:
        if mask.dim() > 4:
            raise RuntimeError
        full = mask.expand(batch, heads, sq, sk)
    except RuntimeError:
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} does not broadcast to [batch, heads, query, key] = "
            f"{[batch, heads, sq, sk]}"
        ) from None
    if mask.dim() == 4 and mask.shape[1] != 1 and not bool((full == full[:, :1]).all()):
        raise ValueError(
            "attn_implementation='flash_attention_2' needs the same mask for every head; this mask differs across "
            "heads, use attn_implementation='sdpa' or 'eager'"
        )
    return full[:, 0]


def _valid_queries(full: torch.Tensor, key_valid: torch.Tensor, causal: bool) -> torch.Tensor:
    """[B, Sq] queries flash computes: those that see a key; in causal self-attention (query i is key
    i + Sk - Sq) also their own key must be real: a padding query is dropped (zeros), as flash-attn's varlen path
    and official transformers' flash_attention_2 drop it, while eager and sdpa let it see the real keys before it."""
    seen = full.any(dim=2)
    sq, sk = full.shape[1], full.shape[2]
    return seen & key_valid[:, sk - sq :] if causal and sk >= sq else seen


def _real_queries_see_keys(full: torch.Tensor, key_valid: torch.Tensor) -> bool:
    """Read as causal self-attention, a query whose own key is real sees at least that key. A mask in which such a
    query sees nothing is no causal padding mask (flash's reading would drop a row the mask computes elsewhere)."""
    sq, sk = full.shape[1], full.shape[2]
    return sk < sq or not bool((key_valid[:, sk - sq :] & ~full.any(dim=2)).any())


def _dropped_rows_are_padding(full, key_valid, query_valid, window: Optional[int]) -> bool:
    """A query row flash drops while it sees keys must be what causal masks give a padding query: every real key
    at or before it (within the window, if any). Any other row is a mask flash cannot express."""
    dropped = full.any(dim=2) & ~query_valid
    if not bool(dropped.any()):
        return True
    sq, sk = full.shape[1], full.shape[2]
    offset = torch.arange(sk, device=full.device)[None, :] - torch.arange(sk - sq, sk, device=full.device)[:, None]
    before = offset <= 0
    allowed = key_valid[:, None, :] & before
    if torch.equal(allowed[dropped], full[dropped]):
        return True
    return window is not None and torch.equal((allowed & (offset > -window))[dropped], full[dropped])


@dataclass
class ChunkedSegments:
    """A chunked causal mask (Llama 4's chunked attention) read as varlen segments: every (row, chunk) pair is a
    causal sequence of its own, its real queries over its real keys, aligned bottom-right. q_idx / k_idx: the real
    rows of [B * Sq] / [B * Sk], in order; q_lens / k_lens: int32 lengths of the segments, row after row (a chunk
    whose keys are all cached has no query)."""

    q_idx: torch.Tensor
    k_idx: torch.Tensor
    q_lens: torch.Tensor
    k_lens: torch.Tensor


def _chunked_or_raise(error: ValueError, mask: torch.Tensor, q: torch.Tensor, sk: int, is_causal: bool) -> ChunkedSegments:
    """The mask of causal attention read as chunked attention, where the padding / causal / window readings
    refused it; their `error` when it is not chunked attention either."""
    chunks = _read_chunks(mask, q, sk) if is_causal else None
    if chunks is None:
        raise error
    return chunks


def _read_chunks(mask: torch.Tensor, q: torch.Tensor, sk: int) -> Optional[ChunkedSegments]:
    """Each real query sees a run of real keys ending at itself, one key longer than its predecessor's (same
    chunk) or only itself (a new chunk starts); padding queries are dropped as in causal masks."""
    try:
        full = _mask_rows(mask, q, sk)
    except ValueError:
        return None
    key_valid = full.any(dim=1)
    query_valid = _valid_queries(full, key_valid, causal=True)
    span = full.sum(-1)  # [B, Sq] keys each query sees
    distance = _real_token_distance(query_valid, key_valid)
    runs = query_valid[:, :, None] & key_valid[:, None, :] & (distance >= 0) & (distance < span[:, :, None])
    if not torch.equal(runs[query_valid], full[query_valid]) or not _dropped_rows_see_runs(full, key_valid, query_valid):
        return None
    rows = [_chunk_lengths(span[b][query_valid[b]].tolist(), int(key_valid[b].sum())) for b in range(full.shape[0])]
    if any(row is None for row in rows):
        return None
    q_lens, k_lens = ([n for row in rows for n in row[i]] for i in (0, 1))
    as_int32 = lambda lens: torch.tensor(lens, dtype=torch.int32, device=q.device)
    return ChunkedSegments(query_valid.flatten().nonzero().squeeze(-1), key_valid.flatten().nonzero().squeeze(-1),
                           as_int32(q_lens), as_int32(k_lens))


def _chunk_lengths(spans: list, keys: int) -> Optional[tuple[list, list]]:
    """(queries, keys) of each chunk of one row, whose real queries (the last len(spans) of its `keys` real keys)
    see spans[i] keys each; a first segment holds the keys before the first query's chunk (no query). None when a
    query neither continues its predecessor's chunk nor starts one."""
    if not spans:  # no real query (a padding row, or a padding step): its keys, if any, in one segment
        return [0], [keys]
    if any(span not in (1, previous + 1) for previous, span in zip(spans, spans[1:])):
        return None
    starts = [i for i, span in enumerate(spans) if i == 0 or span == 1]
    first_keys = [keys - len(spans) + i - spans[i] + 1 for i in starts]
    query_bounds, key_bounds = [0, 0] + starts[1:] + [len(spans)], [0] + first_keys + [keys]
    return ([b - a for a, b in zip(query_bounds, query_bounds[1:])],
            [b - a for a, b in zip(key_bounds, key_bounds[1:])])


def _dropped_rows_see_runs(full: torch.Tensor, key_valid: torch.Tensor, query_valid: torch.Tensor) -> bool:
    """A query row flash drops while it sees keys must see a run of the real keys ending at the last one at or
    before it: what a chunked (or causal, or windowed) mask gives a padding query."""
    dropped = full.any(dim=2) & ~query_valid
    if not bool(dropped.any()):
        return True
    sq, sk = full.shape[1], full.shape[2]
    before = torch.arange(sk, device=full.device)[None, :] <= torch.arange(sk - sq, sk, device=full.device)[:, None]
    allowed, seen = (key_valid[:, None, :] & before)[dropped], full[dropped]
    from_last = allowed.flip(-1).cumsum(-1).flip(-1)  # 1 at the last allowed key, 2 at the one before, ...
    return torch.equal(seen, allowed & (from_last <= seen.sum(-1, keepdim=True)))


def _flash_sdpa(q, k, v, *, scale, dropout_p, is_causal, sinks=None) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    value_dim = v.shape[-1]
    if sinks is not None:  # the sink key comes first: the bottom-right causal mask below keeps it visible
        q, k, v, _ = sink_as_first_key(q, k, v, None, sinks, scale)
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    if is_causal and q.shape[2] == 1:
        is_causal = False
    mask = None
    if is_causal and q.shape[2] != k.shape[2] and q.device.type == "cpu":
        # PyTorch's CPU flash kernel takes a mask (its CUDA one does not): the bottom-right causal chunk, explicitly.
        mask, is_causal = causal_bool_mask(q.shape[2], k.shape[2], q.device), False
    if is_causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            "attn_implementation='flash_attention_2' without the flash-attn package cannot run a causal step with "
            f"{q.shape[2]} new queries over {k.shape[2]} keys; install flash-attn or use 'sdpa'"
        )
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                                 scale=scale)
        return out if sinks is None else out[..., :value_dim]
    except RuntimeError as error:
        if "No available kernel" not in str(error):
            raise
        raise ValueError(
            f"attn_implementation='flash_attention_2': PyTorch's flash kernel cannot run q {tuple(q.shape)} "
            f"{q.dtype} on this GPU (head_dim or GPU unsupported, see the warnings above); install flash-attn or "
            "use attn_implementation='sdpa' or 'eager'"
        ) from None


def _flash_attn_functions():
    """(flash_attn_func, flash_attn_varlen_func) of the flash-attn package."""
    # Inside try: so that transformers' remote-code import check (which skips try blocks) does not demand the
    # optional flash-attn package from every machine that downloads a pushed model.
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError as error:
        raise ImportError(f"the flash-attn package is installed but cannot be imported: {error}") from error
    return flash_attn_func, flash_attn_varlen_func


def _flash_package(q, k, v, query_valid, key_valid, *, scale, dropout_p, is_causal) -> torch.Tensor:
    flash_attn_func, flash_attn_varlen_func = _flash_attn_functions()

    # flash-attn works in [B, S, H, D] and aligns causal masks bottom-right, as we do.
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
    if query_valid is None:
        out = flash_attn_func(q_, k_, v_, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal)
        return out.transpose(1, 2)
    batch, sq = query_valid.shape
    q_idx = query_valid.flatten().nonzero().squeeze(-1)
    k_idx = key_valid.flatten().nonzero().squeeze(-1)
    q_lens = query_valid.sum(-1, dtype=torch.int32)
    k_lens = key_valid.sum(-1, dtype=torch.int32)
    cu_q = F.pad(q_lens.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = F.pad(k_lens.cumsum(0, dtype=torch.int32), (1, 0))
    out_packed = flash_attn_varlen_func(
        q_.flatten(0, 1)[q_idx],
        k_.flatten(0, 1)[k_idx],
        v_.flatten(0, 1)[k_idx],
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=int(k_lens.max()),
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=is_causal,
    )
    out = q_.new_zeros(batch * sq, *q_.shape[2:])
    out[q_idx] = out_packed
    return out.view(batch, sq, *q_.shape[2:]).transpose(1, 2)


def flash_attention(q, k, v, mask=None, *, scale: float, dropout_p: float = 0.0, is_causal: bool = False,
                    output_attentions: bool = False, segment_ids=None, sinks=None) -> BackendOutput:
    """FlashAttention: the flash-attn package (CUDA, varlen for padded batches) when installed; otherwise on CUDA
    our Triton kernel (hf_tiny_flash_attention, one varlen call; with attention dropout, which it lacks, PyTorch's
    flash kernel one sequence at a time), and on CPU PyTorch's FLASH_ATTENTION SDPA kernel (one sequence at a time
    for padded batches). Attention sinks, which the flash-attn package lacks, run on our Triton kernel on CUDA."""
    _no_weights(output_attentions, "flash_attention_2")
    _check_one_head_dim(q, k, v, backend="flash_attention_2")
    check_flash_can_run(q.device, q.dtype)
    package = flash_attn_package_available(q.device)
    if q.device.type == "cuda" and (not package or sinks is not None) and dropout_p == 0.0:
        # our Triton kernel: one varlen call for padded and packed batches (PyTorch's flash kernel takes neither)
        return _triton_flash(q, k, v, mask, scale=scale, is_causal=is_causal, segment_ids=segment_ids, sinks=sinks), None
    if sinks is not None and (package or q.device.type == "cuda"):
        raise ValueError(
            f"attn_implementation='flash_attention_2' cannot combine attention sinks with attention dropout "
            f"(dropout_p={dropout_p}) on {q.device.type}: the flash-attn package has no sinks and hf_tiny's Triton kernel "
            "no dropout; call model.eval() or use attn_implementation='sdpa' or 'eager'"
        )
    if segment_ids is not None:
        return _flash_packed(q, k, v, segment_ids, scale=scale, dropout_p=dropout_p, is_causal=is_causal, sinks=sinks), None
    query_valid = key_valid = None
    if mask is not None:
        try:
            query_valid, key_valid, is_causal = _padding_pattern(mask, q, k.shape[2], is_causal)
        except ValueError as error:
            chunks = _chunked_or_raise(error, mask, q, k.shape[2], is_causal)
            return _flash_chunks(q, k, v, chunks, scale=scale, dropout_p=dropout_p, sinks=sinks), None
        if bool(query_valid.all()) and bool(key_valid.all()):
            query_valid = key_valid = None
    if package:
        return _flash_package(q, k, v, query_valid, key_valid, scale=scale, dropout_p=dropout_p, is_causal=is_causal), None
    flash = functools.partial(_flash_sdpa, scale=scale, dropout_p=dropout_p, is_causal=is_causal, sinks=sinks)
    if query_valid is None:
        return flash(q, k, v), None
    out = q.new_zeros(q.shape)
    for b in range(q.shape[0]):  # PyTorch's flash kernel takes no padding: one sequence at a time
        qi, ki = query_valid[b].nonzero().squeeze(-1), key_valid[b].nonzero().squeeze(-1)
        if qi.numel() and ki.numel():
            out[b : b + 1, :, qi] = flash(q[b : b + 1, :, qi], k[b : b + 1, :, ki], v[b : b + 1, :, ki])
    return out, None


def _check_segment_ids(segment_ids: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    batch, _, seq, _ = q.shape
    if k.shape[2] != seq or tuple(segment_ids.shape) != (batch, seq):
        raise ValueError(
            f"segment_ids of shape {tuple(segment_ids.shape)} describe packed self-attention over [batch, seq] = "
            f"{[batch, seq]} with as many keys as queries; got {k.shape[2]} keys"
        )


def _segment_lengths(segment_ids: torch.Tensor) -> torch.Tensor:
    """Lengths of the packed sequences in [B, S] segment ids, in order over the whole batch (a run of equal ids in
    a row is one sequence; row b's come after those of rows < b)."""
    batch, seq = segment_ids.shape
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return torch.diff(F.pad(starts.flatten().nonzero().squeeze(-1), (0, 1), value=batch * seq))


def _flash_packed(q, k, v, segment_ids, *, scale, dropout_p, is_causal, sinks=None) -> torch.Tensor:
    """Self-attention over packed rows: every sequence (a run of equal segment ids in a row) attends only to
    itself. The flash-attn package takes them all in one varlen call; PyTorch's kernel runs them one by one."""
    batch, heads, seq, dim = q.shape
    _check_segment_ids(segment_ids, q, k)
    lengths = _segment_lengths(segment_ids).to(torch.int32)
    q_, k_, v_ = (t.transpose(1, 2).flatten(0, 1) for t in (q, k, v))  # [B*S, H, D]
    out = _flash_varlen_rows(q_, k_, v_, lengths, lengths, scale=scale, dropout_p=dropout_p, is_causal=is_causal,
                             sinks=sinks)
    return out.view(batch, seq, heads, dim).transpose(1, 2)


def _flash_chunks(q, k, v, chunks: ChunkedSegments, *, scale, dropout_p, sinks=None) -> torch.Tensor:
    """Chunked causal attention: every (row, chunk) segment as one causal sequence; padding query rows are zeros."""
    batch, heads, sq, dim = q.shape
    q_ = q.transpose(1, 2).flatten(0, 1).index_select(0, chunks.q_idx)
    k_, v_ = (t.transpose(1, 2).flatten(0, 1).index_select(0, chunks.k_idx) for t in (k, v))
    out = _flash_varlen_rows(q_, k_, v_, chunks.q_lens, chunks.k_lens, scale=scale, dropout_p=dropout_p, is_causal=True,
                             sinks=sinks)
    out = out.new_zeros(batch * sq, heads, dim).index_copy(0, chunks.q_idx, out)
    return out.view(batch, sq, heads, dim).transpose(1, 2)


def _flash_varlen_rows(q_, k_, v_, q_lens, k_lens, *, scale, dropout_p, is_causal, sinks=None) -> torch.Tensor:
    """Attention over packed rows [T, H, D], segment s being q_lens[s] queries over k_lens[s] keys (int32): the
    flash-attn package in one varlen call (never given sinks: flash_attention refuses them there), else PyTorch's
    flash kernel one segment at a time."""
    if flash_attn_package_available(q_.device):
        flash_attn_varlen_func = _flash_attn_functions()[1]
        return flash_attn_varlen_func(
            q_, k_, v_, cu_seqlens_q=_offsets(q_lens), cu_seqlens_k=_offsets(k_lens), max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(k_lens.max()), dropout_p=dropout_p, softmax_scale=scale, causal=is_causal,
        )
    outputs = [q_.new_zeros(0, *q_.shape[1:])]
    for part_q, part_k, part_v in zip(*(t.split(n.tolist()) for t, n in ((q_, q_lens), (k_, k_lens), (v_, k_lens)))):
        if part_q.shape[0]:  # a segment of cached keys only has no query to compute
            part = _flash_sdpa(*(t.transpose(0, 1)[None] for t in (part_q, part_k, part_v)),
                               scale=scale, dropout_p=dropout_p, is_causal=is_causal, sinks=sinks)
            outputs.append(part[0].transpose(0, 1))
    return torch.cat(outputs)


# ----------------------------------------------------------------------------------------------------------------
# Our Triton FlashAttention kernel (hf_tiny/flash_triton.py): one varlen call per layer for padded or packed batches
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class VarlenLayout:
    """Where a batch's real tokens are, in the packed layout varlen kernels take: q_idx / k_idx index the real
    rows of [B * S] (None: every row is real), cu_q / cu_k are int32 [B + 1] sequence offsets into the packed
    rows; causal / window as read from the mask."""

    q_idx: Optional[torch.Tensor]
    k_idx: Optional[torch.Tensor]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    window: Optional[int]


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _varlen_layout(q, k, mask, is_causal: bool, segment_ids) -> VarlenLayout:
    batch, _, sq, _ = q.shape
    sk = k.shape[2]
    device = q.device
    if segment_ids is not None:
        _check_segment_ids(segment_ids, q, k)
        lengths = _segment_lengths(segment_ids)
        cu = _offsets(lengths)
        longest = int(lengths.max())
        return VarlenLayout(None, None, cu, cu, longest, longest, is_causal, None)
    if mask is None:
        cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32) * sq
        cu_k = torch.arange(batch + 1, device=device, dtype=torch.int32) * sk
        return VarlenLayout(None, None, cu_q, cu_k, sq, sk, is_causal, None)
    try:
        query_valid, key_valid, causal, window = _read_mask(mask, q, sk, is_causal, allow_window=True)
    except ValueError as error:
        chunks = _chunked_or_raise(error, mask, q, sk, is_causal)
        return VarlenLayout(chunks.q_idx, chunks.k_idx, _offsets(chunks.q_lens), _offsets(chunks.k_lens),
                            int(chunks.q_lens.max()), int(chunks.k_lens.max()), True, None)
    q_lens, k_lens = query_valid.sum(-1), key_valid.sum(-1)
    q_idx = None if bool(query_valid.all()) else query_valid.flatten().nonzero().squeeze(-1)
    k_idx = None if bool(key_valid.all()) else key_valid.flatten().nonzero().squeeze(-1)
    return VarlenLayout(q_idx, k_idx, _offsets(q_lens), _offsets(k_lens), int(q_lens.max()), int(k_lens.max()),
                        causal, window)


class _LastLayout:
    """The layout of the last mask (or segment ids) seen. Every layer of a forward pass gets the same mask object
    (masks are built once per layer type), so the mask is read, with its host syncs, once per batch rather than
    once per layer; a new or modified (in place) tensor is read again. The entry is one tuple, replaced whole, so
    forwards in several threads never see one mask's key with another's layout."""

    def __init__(self):
        self.last = None  # (weak reference to the mask, key, layout)

    def get(self, q, k, mask, is_causal, segment_ids) -> VarlenLayout:
        source = segment_ids if segment_ids is not None else mask
        if source is None:
            return _varlen_layout(q, k, mask, is_causal, segment_ids)
        key = (_version(source), tuple(q.shape[:3]), k.shape[2], is_causal, segment_ids is not None, q.device)
        last = self.last
        if last is not None and last[0]() is source and last[1] == key:
            return last[2]
        layout = _varlen_layout(q, k, mask, is_causal, segment_ids)
        self.last = (weakref.ref(source), key, layout)
        return layout


_LAST_LAYOUT = _LastLayout()


def _version(tensor: torch.Tensor) -> Optional[int]:
    """The in-place modification counter; inference-mode tensors have none (and cannot change outside it)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _triton_kernel() -> SimpleNamespace:
    # `from .flash_triton import ...` (not `from . import flash_triton`): the form transformers follows when it
    # copies a model's code files into a saved folder.
    try:
        from .flash_triton import check_device_and_dtype, check_kernel_can_run, flash_attn_varlen
    except ImportError as error:
        raise ValueError(f"{error}; or use attn_implementation='sdpa'") from None
    return SimpleNamespace(check_device_and_dtype=check_device_and_dtype, check_kernel_can_run=check_kernel_can_run,
                           flash_attn_varlen=flash_attn_varlen)


def _triton_flash(q, k, v, mask, *, scale, is_causal, segment_ids, sinks=None) -> torch.Tensor:
    """[B, H, S, D] attention through our kernel: real rows gathered into the packed layout, one kernel call,
    scattered back (padding rows are zeros)."""
    kernel = _triton_kernel()
    kernel.check_kernel_can_run(q, k, v)
    layout = _LAST_LAYOUT.get(q, k, mask, is_causal, segment_ids)
    batch, heads, sq, dim = q.shape
    packed_q = q.transpose(1, 2).reshape(batch * sq, heads, dim)
    packed_k, packed_v = (t.transpose(1, 2).reshape(batch * k.shape[2], k.shape[1], dim) for t in (k, v))
    if layout.q_idx is not None:
        packed_q = packed_q.index_select(0, layout.q_idx)
    if layout.k_idx is not None:
        packed_k, packed_v = packed_k.index_select(0, layout.k_idx), packed_v.index_select(0, layout.k_idx)
    out = kernel.flash_attn_varlen(
        packed_q, packed_k, packed_v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k,
        scale=scale, causal=layout.causal, window=layout.window, sinks=sinks,
    )
    if layout.q_idx is not None:
        out = out.new_zeros(batch * sq, heads, dim).index_copy(0, layout.q_idx, out)
    return out.view(batch, sq, heads, dim).transpose(1, 2)


def hf_tiny_flash_attention(q, k, v, mask=None, *, scale: float, dropout_p: float = 0.0, is_causal: bool = False,
                            output_attentions: bool = False, segment_ids=None, sinks=None) -> BackendOutput:
    """hf_tiny's own FlashAttention kernel in Triton (hf_tiny/flash_triton.py): padded and packed batches in one
    varlen call, GQA without repeated K/V, causal and sliding-window masks, attention sinks, fp16/bf16/fp32. Runs on
    CUDA, and on CPU under Triton's interpreter (TRITON_INTERPRET=1)."""
    _no_weights(output_attentions, "hf_tiny_flash")
    if dropout_p > 0:
        raise ValueError(
            f"attn_implementation='hf_tiny_flash' has no attention dropout, got dropout_p={dropout_p}; set the config's "
            "attention dropout to 0, call model.eval(), or use attn_implementation='sdpa'"
        )
    _check_one_head_dim(q, k, v, backend="hf_tiny_flash")
    return _triton_flash(q, k, v, mask, scale=scale, is_causal=is_causal, segment_ids=segment_ids, sinks=sinks), None


def _checked(backend: Callable[..., BackendOutput]) -> Callable[..., BackendOutput]:
    """The backend with the shapes of q, k, v and sinks checked first: the entry for callers that make their own.
    Attention modules call the backends themselves (HF_TINY_INTERFACES): their projections give these shapes by
    construction, from a checked config."""

    @functools.wraps(backend)
    def checked_backend(q, k, v, mask=None, *, sinks=None, **kwargs) -> BackendOutput:
        _check_shapes(q, k, v, sinks=sinks)
        return backend(q, k, v, mask, sinks=sinks, **kwargs)

    return checked_backend


_BACKENDS = {"eager": naive_attention, "sdpa": torch_attention, "flash_attention_2": flash_attention,
             "hf_tiny_flash": hf_tiny_flash_attention}
# The backends by name, each checking its inputs (_checked).
ATTENTION_BACKENDS: dict[str, Callable[..., BackendOutput]] = {name: _checked(fn) for name, fn in _BACKENDS.items()}


def get_attention_backend(name: str) -> Callable[..., BackendOutput]:
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"attn_implementation={name!r} is not an hf_tiny attention backend; choose one of "
            f"{sorted(ATTENTION_BACKENDS)} ('eager' = naive formula, 'sdpa' = torch SDPA, "
            "'flash_attention_2' = FlashAttention kernels, 'hf_tiny_flash' = our Triton FlashAttention kernel)"
        ) from None


def check_backend_can_run(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raises a clear ValueError when hf_tiny backend `name` is unknown or cannot run on this device / dtype."""
    get_attention_backend(name)
    if name == "flash_attention_2":
        check_flash_can_run(torch.device(device), dtype)
    if name == "hf_tiny_flash":
        _triton_kernel().check_device_and_dtype(torch.device(device), dtype)


# ----------------------------------------------------------------------------------------------------------------
# Our backends as transformers' attention interface: attention modules call
# `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)(module, q, k, v, mask, scaling=...)`.
# ----------------------------------------------------------------------------------------------------------------

AttentionInterfaceFn = Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]


def as_attention_interface(backend: Callable[..., BackendOutput]) -> AttentionInterfaceFn:
    """One of our pure backends in transformers' attention-interface convention (module first, output
    [B, S, H, D]). Keyword arguments it does not use (sliding_window, position_ids, ...) are accepted and ignored:
    our masks already hold them. s_aux: attention sinks, under transformers' name (official GPT-OSS passes it)."""

    def attention_forward(
        module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, is_causal=None,
        output_attentions=False, segment_ids=None, s_aux=None, **kwargs,
    ):
        out, weights = backend(
            query, key, value, attention_mask,
            scale=module.scaling if scaling is None else scaling,
            dropout_p=dropout,
            is_causal=getattr(module, "is_causal", False) if is_causal is None else is_causal,
            output_attentions=output_attentions,
            segment_ids=segment_ids,
            sinks=s_aux,
        )
        return out.transpose(1, 2), weights

    attention_forward.__name__ = attention_forward.__qualname__ = f"hf_tiny_{backend.__name__}_interface"
    return attention_forward


HF_TINY_INTERFACES: dict[str, AttentionInterfaceFn] = {
    name: as_attention_interface(backend) for name, backend in _BACKENDS.items()
}


def is_hf_tiny_backend(name: str) -> bool:
    """Our own backends, also under transformers' "paged|" prefix (our wrappers handle paged caches)."""
    return name.removeprefix("paged|") in HF_TINY_INTERFACES


def _hf_tiny_attention_functions():
    """transformers' AttentionInterface with our backends registered locally (its mechanism for a model's own
    overrides): our math under "eager", "sdpa", "flash_attention_2" (and "paged|eager"); every other name from the
    global mapping (flex_attention, vLLM's, functions users register with AttentionInterface.register). Registering
    ours globally would replace transformers' sdpa in every official model of the process."""
    from transformers import AttentionInterface

    functions = AttentionInterface()
    for name, function in HF_TINY_INTERFACES.items():
        functions[name] = function
    functions["paged|eager"] = HF_TINY_INTERFACES["eager"]
    return functions


HF_TINY_ATTENTION_FUNCTIONS = _hf_tiny_attention_functions()
# The name attention modules look the function up under. vLLM's Transformers backend finds the attention module by
# reading its forward's source for `<name> = ALL_ATTENTION_FUNCTIONS.get_interface(...)` and exactly one call of
# <name>, so the lookup is spelled that way (it is still our instance, which falls back to transformers' global one).
ALL_ATTENTION_FUNCTIONS = HF_TINY_ATTENTION_FUNCTIONS


def registered_attention_names() -> list[str]:
    return sorted(HF_TINY_ATTENTION_FUNCTIONS.valid_keys())


def get_attention_interface(name: str) -> AttentionInterfaceFn:
    """The attention function `config._attn_implementation` names: ours, or one transformers holds."""
    try:
        return HF_TINY_ATTENTION_FUNCTIONS.get_interface(name, None)
    except (KeyError, ValueError):
        raise ValueError(
            f"attn_implementation={name!r} is neither an hf_tiny backend ({sorted(HF_TINY_INTERFACES)}) nor registered "
            f"in transformers' AttentionInterface; registered: {registered_attention_names()} (add one with "
            "transformers.AttentionInterface.register(name, fn))"
        ) from None


def _takes_s_aux(function: Callable) -> bool:
    try:
        return "s_aux" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read: nothing says it takes sinks
        return False


def sinks_for(name: str, function: Callable, sinks: torch.Tensor) -> torch.Tensor:
    """Attention sinks reach an attention function as transformers' `s_aux`. A foreign function without that
    parameter (transformers' sdpa and paged ones, vLLM's: they take **kwargs) would drop them silently and compute
    attention without sinks, so it is refused."""
    if name not in HF_TINY_INTERFACES and not _takes_s_aux(function):
        raise ValueError(
            f"attn_implementation={name!r} does not take attention sinks (no `s_aux` parameter), which this model's "
            f"attention needs; use one that does: {sorted(HF_TINY_INTERFACES)}, or flex_attention on CUDA"
        )
    return sinks

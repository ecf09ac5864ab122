"""Attention backends: the math of softmax(Q Kᵀ · scale + M) V, and nothing else.

Every backend has the same signature and never sees a config or a module, so they can be tested against each
other in isolation:

    fn(q, k, v, mask=None, *, scale, dropout_p=0.0, is_causal=False, output_attentions=False)
        -> (out [B, H, Sq, D], weights [B, H, Sq, Sk] or None)

q is [B, H, Sq, D]; k and v are [B, Hkv, Sk, D] with H a multiple of Hkv (GQA / MQA).
mask is None, a bool tensor (True = attend) or a float additive tensor, broadcastable to [B, H, Sq, Sk]. A given
mask is complete (causality already inside it). `is_causal` says whether the attention is causal: with no mask
the backend applies it, aligned bottom-right (query i sees keys j <= i + Sk - Sq, the rule for decoding after a
KV cache); with a mask, naive and sdpa ignore it and flash uses it to rebuild the mask for its kernels.
A query row with no visible key returns zeros, never NaN, in every backend.

Names follow Hugging Face habits: "eager" is the naive formula, "sdpa" is torch's
scaled_dot_product_attention, "flash_attention_2" runs FlashAttention kernels on CUDA.
"""

from __future__ import annotations

import importlib.util
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


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects 4-D q, k, v [batch, heads, seq, head_dim]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)} and v {tuple(v.shape)}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads != 0:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    return heads // kv_heads


def causal_bool_mask(query_length: int, key_length: int, device: torch.device) -> torch.Tensor:
    """[Sq, Sk] bool, True where query i may see key j (bottom-right aligned)."""
    offset = key_length - query_length
    rows = torch.arange(query_length, device=device)[:, None]
    cols = torch.arange(key_length, device=device)[None, :]
    return cols <= rows + offset


def _visible_rows(mask: torch.Tensor) -> torch.Tensor:
    """Bool [..., Sq, 1]: True where the query row sees at least one key."""
    if mask.dtype == torch.bool:
        return mask.any(dim=-1, keepdim=True)
    return (mask > torch.finfo(mask.dtype).min / 2).any(dim=-1, keepdim=True)


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    scale: float,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    output_attentions: bool = False,
) -> BackendOutput:
    """softmax(Q Kᵀ · scale + M) V written out; the reference the other backends are tested against."""
    n_rep = _check_shapes(q, k, v)
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is None and is_causal:
        mask = causal_bool_mask(q.shape[2], k.shape[2], q.device)
    if mask is not None:
        lowest = torch.finfo(scores.dtype).min
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, lowest)
        else:
            scores = (scores + mask.to(scores.dtype)).clamp(min=lowest)
    # Softmax in fp32 as the official models do, then back to the activation dtype.
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if mask is not None:
        weights = weights * _visible_rows(mask).to(weights.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    out = torch.matmul(weights, v)
    return out, (weights if output_attentions else None)


# SDPA shares KV heads itself (enable_gqa) from torch 2.5 on; older builds get repeated K/V.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    scale: float,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    output_attentions: bool = False,
) -> BackendOutput:
    """torch.nn.functional.scaled_dot_product_attention (picks flash / memory-efficient / math kernels itself)."""
    if output_attentions:
        raise ValueError(
            "output_attentions=True needs the attention weights, which the 'sdpa' backend does not compute; "
            "use attn_implementation='eager'"
        )
    n_rep = _check_shapes(q, k, v)
    sq, sk = q.shape[2], k.shape[2]
    if mask is not None:
        is_causal = False
    elif is_causal and sq != sk:
        # SDPA's is_causal is top-left aligned; a single new query (decoding) sees everything, otherwise
        # build the bottom-right mask explicitly.
        if sq == 1:
            is_causal = False
        else:
            mask, is_causal = causal_bool_mask(sq, sk, q.device), False
    gqa_kwargs = {}
    if n_rep > 1:
        if _SDPA_HAS_GQA:
            gqa_kwargs["enable_gqa"] = True
        else:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **gqa_kwargs
    )
    if mask is not None:
        # Fully masked rows: SDPA gives NaN (or a uniform average on some kernels); the contract is zeros.
        out = out.masked_fill(~_visible_rows(mask), 0.0)
    return out, None


FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_attn_package_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def check_flash_can_run(device: torch.device, dtype: torch.dtype) -> None:
    """Flash kernels exist only for CUDA tensors in fp16/bf16; anything else is a clear error, never a fallback."""
    if device.type != "cuda":
        raise ValueError(
            f"attn_implementation='flash_attention_2' needs CUDA tensors, got device '{device}'; "
            "use attn_implementation='sdpa' or 'eager' on this device"
        )
    if dtype not in FLASH_DTYPES:
        raise ValueError(
            f"attn_implementation='flash_attention_2' runs in float16 or bfloat16, got dtype {dtype}; cast the model "
            "(model.to(torch.bfloat16)) or use attn_implementation='sdpa' or 'eager'"
        )


def _padding_pattern(mask: torch.Tensor, sq: int, sk: int, is_causal: bool):
    """Reads a bool mask as per-sequence padding: which queries and keys are real.

    Flash kernels take only "real tokens + optional causal" patterns; any other mask (sliding windows, custom
    4-D masks, additive biases) cannot be expressed and raises instead of computing something else.
    """
    if mask.dtype != torch.bool:
        raise ValueError(
            "attn_implementation='flash_attention_2' cannot apply an additive (float) attention mask or position "
            "bias; use attn_implementation='sdpa' or 'eager'"
        )
    batch = mask.shape[0]
    full = mask.expand(batch, 1, sq, sk)[:, 0]
    key_valid = full.any(dim=1)  # [B, Sk]
    query_valid = full.any(dim=2)  # [B, Sq]
    rebuilt = query_valid[:, :, None] & key_valid[:, None, :]
    if is_causal:
        # Causal within the real tokens, aligned bottom-right (the last real query sees the last real key).
        q_pos = query_valid.long().cumsum(-1) + (key_valid.sum(-1, keepdim=True) - query_valid.sum(-1, keepdim=True))
        k_pos = key_valid.long().cumsum(-1)
        rebuilt = rebuilt & (k_pos[:, None, :] <= q_pos[:, :, None])
    if not torch.equal(rebuilt, full):
        raise ValueError(
            "attn_implementation='flash_attention_2' supports padding and causal masks only; this mask (for "
            "example a sliding window or a custom 4-D mask) needs attn_implementation='sdpa' or 'eager'"
        )
    return query_valid, key_valid


def _flash_sdpa(q, k, v, *, scale, dropout_p, is_causal) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    if is_causal and q.shape[2] == 1:
        is_causal = False
    if is_causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            "attn_implementation='flash_attention_2' without the flash-attn package cannot run a causal step with "
            f"{q.shape[2]} new queries over {k.shape[2]} keys; install flash-attn or use 'sdpa'"
        )
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


def _flash_package(q, k, v, query_valid, key_valid, *, scale, dropout_p, is_causal) -> torch.Tensor:
    from flash_attn import flash_attn_func, flash_attn_varlen_func

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


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    scale: float,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    output_attentions: bool = False,
) -> BackendOutput:
    """FlashAttention on CUDA: the flash-attn package (varlen for padded batches) when installed, otherwise
    PyTorch's FLASH_ATTENTION SDPA kernel, one sequence at a time for padded batches."""
    if output_attentions:
        raise ValueError(
            "output_attentions=True needs the attention weights, which 'flash_attention_2' does not compute; "
            "use attn_implementation='eager'"
        )
    _check_shapes(q, k, v)
    check_flash_can_run(q.device, q.dtype)
    sq, sk = q.shape[2], k.shape[2]
    query_valid = key_valid = None
    if mask is not None:
        query_valid, key_valid = _padding_pattern(mask, sq, sk, is_causal)
        if bool(query_valid.all()) and bool(key_valid.all()):
            query_valid = key_valid = None
    if flash_attn_package_available():
        return _flash_package(q, k, v, query_valid, key_valid, scale=scale, dropout_p=dropout_p, is_causal=is_causal), None
    if query_valid is None:
        return _flash_sdpa(q, k, v, scale=scale, dropout_p=dropout_p, is_causal=is_causal), None
    out = q.new_zeros(q.shape)
    for b in range(q.shape[0]):
        qi, ki = query_valid[b].nonzero().squeeze(-1), key_valid[b].nonzero().squeeze(-1)
        if qi.numel() == 0 or ki.numel() == 0:
            continue
        out[b : b + 1, :, qi] = _flash_sdpa(
            q[b : b + 1, :, qi], k[b : b + 1, :, ki], v[b : b + 1, :, ki],
            scale=scale, dropout_p=dropout_p, is_causal=is_causal,
        )
    return out, None


ATTENTION_BACKENDS: dict[str, Callable[..., BackendOutput]] = {
    "eager": naive_attention,
    "sdpa": torch_attention,
    "flash_attention_2": flash_attention,
}


def get_attention_backend(name: str) -> Callable[..., BackendOutput]:
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"attn_implementation={name!r} is not an hf_tiny attention backend; choose one of "
            f"{sorted(ATTENTION_BACKENDS)} ('eager' = naive formula, 'sdpa' = torch SDPA, "
            "'flash_attention_2' = FlashAttention on CUDA)"
        ) from None

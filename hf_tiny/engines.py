"""The conventions of the engines that run hf_tiny models besides its own attention functions, in one place:
transformers' other attention functions (the masks they take), continuous batching's paged cache, and what vLLM's
Transformers backend reads.

- vLLM's Transformers backend finds attention modules by reading their forward's source for
  `ALL_ATTENTION_FUNCTIONS.get_interface(...)` and one call of it (with `scaling=` and `s_aux=` written there as
  `self.` attributes, which it reads), fuses q/k/v and gate/up by tracing the modules (plain nn.Linear projections
  named q_proj ... / gate_proj, up_proj with act_fn called once), sets `config._attn_implementation = "vllm"` and
  passes flattened sequences with `position_ids` counted from 0 and no mask (vllm_encoder_positions).
- transformers' own functions (flex_attention, paged|eager, hub kernels, a user's `AttentionInterface.register`)
  take transformers' mask forms (`foreign_mask`); those without a mask builder get none. flex_attention also takes
  a BlockMask as it comes (generate builds one per layer type for a static cache, `create_masks_for_generate`).
- Continuous batching (`generate_batch`) passes its paged cache as `cache=` and its indices and sequence
  boundaries as keyword arguments; attention modules store K/V through `paged_cache_update`.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from .masks import causal_bool_mask, visible_rows

VLLM = "vllm"  # the attn_implementation vLLM's Transformers backend sets


def vllm_encoder_positions(config, position_ids: torch.Tensor) -> torch.Tensor:
    """An encoder's position ids under vLLM, which counts each sequence's positions from 0. RoBERTa counts from
    pad_token_id + 1 (positions_from_padding); vLLM adds that offset itself only for model types named "roberta",
    so here. A local-attention encoder (ModernBERT) is refused: vLLM reads `sliding_window` as a causal window of
    that many keys, ours is the reach on either side, so its attention would be one key narrower each way."""
    if "sliding_attention" in config.attention_types():
        raise ValueError(
            f"vLLM cannot serve this encoder's local attention: it reads sliding_window={config.sliding_window} as "
            "a causal window of that many keys, where it is the reach on either side of each token (ModernBERT's "
            "local_attention // 2); its embeddings would differ from the model's. Serve it with transformers"
        )
    return position_ids + config.pad_token_id + 1 if config.positions_from_padding else position_ids


def paged_cache_update(cache, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: dict):
    """Stores this step's K/V [1, Hkv, S, D] in transformers' PagedAttentionCache and returns the sequences' K/V
    [1, Hkv, T, D]. Its API changed in transformers 5.2x: it takes the runner's kwargs (updated in place) and returns
    [1, Hkv, T, D]; before, it took read_index / write_index and returned [T, Hkv, D]."""
    if "kwargs" in inspect.signature(cache.update).parameters:
        return cache.update(key_states=key, value_states=value, layer_idx=layer_idx, kwargs=kwargs)
    key, value = cache.update(
        key_states=key, value_states=value, layer_idx=layer_idx, read_index=kwargs["read_index"],
        write_index=kwargs["write_index"],
    )
    return key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)


def is_block_mask(mask) -> bool:
    """Whether `mask` is a flex_attention BlockMask, transformers' mask form for flex_attention."""
    if mask is None or isinstance(mask, (torch.Tensor, dict)):
        return False
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(mask, BlockMask)


def check_block_mask(implementation: str, field: str) -> None:
    """A BlockMask is handed to flex_attention as it is; no other attention function takes one."""
    if implementation != "flex_attention":
        raise ValueError(
            f"{field} is a flex_attention BlockMask, which only attn_implementation='flex_attention' takes; this "
            f"model's attn_implementation is {implementation!r}: pass a 2-D padding mask or a 4-D mask instead"
        )


def interface_takes_mask(name: str) -> bool:
    """Whether transformers' function `name` is handed a mask, by transformers' rule: when a mask builder is
    registered under its name in its AttentionMaskInterface (sdpa, eager, flex_attention, flash...). The rest
    (vLLM's, TGI's, a kernel registered without one) mask from their own metadata and get attention_mask=None."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return name.removeprefix("paged|") in ALL_MASK_ATTENTION_FUNCTIONS.valid_keys()


def mask_for_interface(
    name: str, mask: Optional[torch.Tensor], is_causal: bool, query: torch.Tensor, key_length: int
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Our mask in the form transformers' attention functions take, and which query rows see no key.

    Returns (mask, visible): mask is a full [B, 1 | H, Sq, Sk] additive tensor (0 where attended, the dtype's lowest
    value elsewhere), or for flex_attention a BlockMask built from the bool pattern (flex adds an additive mask to
    every score inside a compiled kernel, which PyTorch's CPU build miscompiles); a given BlockMask as it is. A
    causal call without a mask gets the explicit bottom-right causal pattern (transformers' functions would otherwise
    read no mask as "see all").
    visible [B, 1, Sq, 1] is False for query rows that see no key (left padding): those rows are handed to the
    function as attending to everything, so no kernel turns them into NaN that later layers would read, and the
    caller zeroes them after, as our own backends do; None when every row sees a key.
    """
    if is_block_mask(mask):  # built for flex_attention (step.causal_masks admits it for that function alone)
        return mask, None
    batch, _, query_length, _ = query.shape
    dtype = query.dtype
    if mask is None:
        if not is_causal:
            return None, None
        mask = causal_bool_mask(query_length, key_length, query.device)
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if name == "flex_attention" and mask.dtype != torch.bool:
        raise ValueError(
            "attn_implementation='flex_attention' takes block masks built from a pattern; this layer's mask is an "
            "additive bias (T5's relative position bias, or a float 4-D mask), which hf_tiny does not hand to flex; "
            "use attn_implementation='sdpa' or 'eager'"
        )
    visible = visible_rows(mask).expand(batch, 1, query_length, 1) if mask.shape[1] == 1 else None
    if visible is not None and bool(visible.all()):
        visible = None
    if mask.dtype == torch.bool:
        if visible is not None:
            mask = mask | ~visible
        if name == "flex_attention":
            from torch.nn.attention.flex_attention import create_block_mask

            # 3-D, indexed by the three batched indices alone: torch 2.10 cannot vmap `dense[b, 0, q_idx, kv_idx]`
            dense = mask[:, 0].expand(batch, query_length, key_length).contiguous()

            def mask_mod(b, h, q_idx, kv_idx):
                return dense[b, q_idx, kv_idx]

            return create_block_mask(mask_mod, batch, None, query_length, key_length, device=mask.device), visible
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    elif visible is not None:
        mask = torch.where(visible, mask.to(dtype), 0.0)
    return mask.to(dtype).expand(batch, mask.shape[1], query_length, key_length).contiguous(), visible


def foreign_mask(module, name: str, mask, is_causal: bool, query: torch.Tensor, key_length: int):
    """(mask, is_causal, visible rows or None) for transformers' function `name`: its mask form when it has a mask
    builder; none when it masks from its own metadata (vLLM's), as transformers does."""
    if interface_takes_mask(name):
        mask, visible = mask_for_interface(name, mask, is_causal, query, key_length)
        return mask, is_causal, visible
    return None, module.is_causal, None

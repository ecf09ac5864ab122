"""The calling conventions hf_tiny's models meet, in one place: transformers' attention interface (the adapter of
our backends, the registry models look functions up in, the masks other functions take), continuous batching's
paged cache, and what vLLM's Transformers backend reads.

- Attention modules call `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)` once per
  forward and call the function once, as transformers' models do: vLLM finds attention modules by reading exactly
  that in their forward's source, sets `config._attn_implementation = "vllm"` and passes flattened sequences with
  `position_ids` and no mask. Our registry is transformers' `AttentionInterface` holding our backends (attention.py)
  wrapped in the interface convention under their own names; every other name comes from transformers' global
  mapping (flex_attention, paged|eager, hub kernels, vLLM's, a user's `AttentionInterface.register`).
- Continuous batching (`generate_batch`) passes its paged cache as `cache=` and its indices and sequence
  boundaries as keyword arguments; attention modules store K/V through `update_cache`, which also serves
  transformers' Cache objects.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch

from .attention import ATTENTION_BACKENDS, BackendOutput, visible_rows, causal_bool_mask

AttentionInterfaceFn = Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]


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


def update_cache(cache, key: torch.Tensor, value: torch.Tensor, layer_idx: int, attention_kwargs: dict):
    """Stores this step's K/V [B, Hkv, S, D] in the cache and returns the keys and values to attend to: a
    transformers Cache's update, or continuous batching's paged cache (which also fills attention_kwargs)."""
    from transformers.cache_utils import Cache

    if isinstance(cache, Cache):
        return cache.update(key, value, layer_idx)
    return paged_cache_update(cache, key, value, layer_idx, attention_kwargs)


def as_attention_interface(backend: Callable[..., BackendOutput]) -> AttentionInterfaceFn:
    """One of our pure backends in transformers' attention-interface convention (module first, output
    [B, S, H, D]). Keyword arguments it does not use (sliding_window, position_ids, ...) are accepted and ignored:
    our masks already hold them."""

    def attention_forward(
        module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, is_causal=None,
        output_attentions=False, segment_ids=None, **kwargs,
    ):
        out, weights = backend(
            query, key, value, attention_mask,
            scale=module.scaling if scaling is None else scaling,
            dropout_p=dropout,
            is_causal=getattr(module, "is_causal", False) if is_causal is None else is_causal,
            output_attentions=output_attentions,
            segment_ids=segment_ids,
        )
        return out.transpose(1, 2), weights

    attention_forward.__name__ = attention_forward.__qualname__ = f"hf_tiny_{backend.__name__}_interface"
    return attention_forward


HF_TINY_INTERFACES: dict[str, AttentionInterfaceFn] = {
    name: as_attention_interface(backend) for name, backend in ATTENTION_BACKENDS.items()
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


def interface_takes_mask(name: str) -> bool:
    """Whether the function `name` is handed a mask, by transformers' rule: ours always; another only when a mask
    builder is registered under its name in transformers' AttentionMaskInterface (sdpa, eager, flex_attention,
    flash...). The rest (vLLM's, TGI's, a kernel registered without one) mask from their own metadata and get
    attention_mask=None."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return is_hf_tiny_backend(name) or name.removeprefix("paged|") in ALL_MASK_ATTENTION_FUNCTIONS.valid_keys()


def mask_for_interface(
    name: str, mask: Optional[torch.Tensor], is_causal: bool, query: torch.Tensor, key_length: int
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Our mask in the form transformers' attention functions take, and which query rows see no key.

    Returns (mask, visible): mask is a full [B, 1 | H, Sq, Sk] additive tensor (0 where attended, the dtype's lowest
    value elsewhere), or for flex_attention a BlockMask built from the bool pattern (flex adds an additive mask to
    every score inside a compiled kernel, which PyTorch's CPU build miscompiles). A causal call without a mask gets
    the explicit bottom-right causal pattern (transformers' functions would otherwise read no mask as "see all").
    visible [B, 1, Sq, 1] is False for query rows that see no key (left padding): those rows are handed to the
    function as attending to everything, so no kernel turns them into NaN that later layers would read, and the
    caller zeroes them after, as our own backends do; None when every row sees a key.
    """
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

            dense = mask[:, :1].expand(batch, 1, query_length, key_length).contiguous()

            def mask_mod(b, h, q_idx, kv_idx):
                return dense[b, 0, q_idx, kv_idx]

            return create_block_mask(mask_mod, batch, None, query_length, key_length, device=mask.device), visible
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    elif visible is not None:
        mask = torch.where(visible, mask.to(dtype), 0.0)
    return mask.to(dtype).expand(batch, mask.shape[1], query_length, key_length).contiguous(), visible


def interface_inputs(module, attention_mask, query: torch.Tensor, key: torch.Tensor, attention_kwargs: dict):
    """(mask, is_causal, visible rows or None) for the attention function `module.config._attn_implementation`
    names, from a step.AttentionMask (or None). Our own functions take the mask as it is (and packed rows'
    segment_ids, put into attention_kwargs); transformers' functions with a mask builder take mask_for_interface's
    form; the rest (vLLM's, a kernel registered without a mask builder) mask from their own metadata and get no
    mask, as transformers does."""
    mask, is_causal, segment_ids = attention_mask if attention_mask is not None else (None, False, None)
    implementation = module.config._attn_implementation
    if is_hf_tiny_backend(implementation):
        if segment_ids is not None:
            attention_kwargs["segment_ids"] = segment_ids
        return mask, is_causal, None
    if interface_takes_mask(implementation):
        mask, visible = mask_for_interface(implementation, mask, is_causal, query, key.shape[2])
        return mask, is_causal, visible
    return None, module.is_causal, None


def zero_invisible_rows(out: torch.Tensor, visible: Optional[torch.Tensor]) -> torch.Tensor:
    """Query rows that see no key (padding) give zeros, as in our own backends; out is [B, S, H, D]."""
    return out if visible is None else out.masked_fill(~visible[:, 0, :, 0, None, None], 0.0)

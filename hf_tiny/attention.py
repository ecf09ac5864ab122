"""Attention backends: the math of softmax(Q Kᵀ · scale + M) V, and their registry.

Every backend has the same signature and never sees a config or a module, so they can be tested against each
other in isolation:

    fn(q, k, v, mask=None, *, scale, dropout_p=0.0, is_causal=False, output_attentions=False, layout=None,
       sinks=None) -> (out [B, H, Sq, D], weights [B, H, Sq, Sk] or None)

q is [B, H, Sq, D]; k and v are [B, Hkv, Sk, D] with H a multiple of Hkv (GQA / MQA). ATTENTION_BACKENDS /
get_attention_backend(name) check these shapes before the math; attention modules, whose projections make them
so, call the math directly.
mask is None, a bool tensor (True = attend) or a float additive tensor, broadcastable to [B, H, Sq, Sk]. A given
mask is complete (causality already inside it). `is_causal` says whether the attention is causal: with no mask
the backend applies it, aligned bottom-right (query i sees keys j <= i + Sk - Sq, the rule for decoding after a
KV cache); with a mask, the backends here ignore it. layout (masks.MaskLayout) says what the mask holds — padding,
causality, window, chunks, packed sequences — for the flash kernels, which take sequence boundaries instead of masks
(flash.py); the backends here apply the mask itself and ignore it. hidden_rows ([B | 1, 1, Sq, 1] bool, True where
a query row sees no key, whose output is zeroed): given (masks.with_hidden_rows, once per forward), the mask already
lets those rows see every key; None, the backends that apply the mask derive both at every call.
A query row with no visible key returns zeros, never NaN, in every backend.
sinks ([H], GPT-OSS's attention sinks, transformers' `s_aux`) is one more logit per head in every query's softmax
denominator, attached to no value: softmax([Q Kᵀ · scale + M, sinks[h]]) without its last column, so a row's weights
sum to less than 1 (a row that sees no key gives zeros here too). Naive appends the column, our Triton kernel starts
its online softmax from it, and the kernels without a sink argument (SDPA, PyTorch's flash) see it as one more key
(flash.sink_as_first_key).

Names follow Hugging Face habits: "eager" is the naive formula, "sdpa" is torch's
scaled_dot_product_attention, "flash_attention_2" runs FlashAttention kernels and "hf_tiny_flash" our Triton kernel
by name (both flash.py).

Models call them the way transformers' models call attention, through the attention interface
(`ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)(module, q, k, v, mask, scaling=...)`,
output [B, S, H, D]): the end of this file wraps each backend in that convention and registers it, under its own
name, in an instance of transformers' AttentionInterface whose other names are transformers' (flex_attention,
paged|eager, hub kernels, vLLM's, a user's). What those other functions and engines need is engines.py's.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .engines import VLLM
from .flash import check_flash_can_run, check_triton_can_run, flash_attention, hf_tiny_flash_attention, sink_as_first_key
from .masks import causal_bool_mask, unhidden, visible_rows

BackendOutput = tuple[torch.Tensor, Optional[torch.Tensor]]


def repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * n_rep, S, D], each KV head shared by n_rep consecutive query heads."""
    if n_rep == 1:
        return hidden
    batch, kv_heads, seq, dim = hidden.shape
    hidden = hidden[:, :, None, :, :].expand(batch, kv_heads, n_rep, seq, dim)
    return hidden.reshape(batch, kv_heads * n_rep, seq, dim)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: Optional[torch.Tensor] = None) -> None:
    """Values may be narrower or wider than keys (MLA's v_head_dim) except in the flash kernels (flash.py).
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
                    output_attentions: bool = False, layout=None, sinks=None, hidden_rows=None) -> BackendOutput:
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
        weights = weights.masked_fill(~visible_rows(mask) if hidden_rows is None else hidden_rows, 0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    out = torch.matmul(weights, v)
    return out, (weights if output_attentions else None)


def torch_attention(q, k, v, mask=None, *, scale: float, dropout_p: float = 0.0, is_causal: bool = False,
                    output_attentions: bool = False, layout=None, sinks=None, hidden_rows=None) -> BackendOutput:
    """torch's scaled_dot_product_attention (it picks the flash, memory-efficient or math kernel). A row that sees
    no key is handed to the kernel as seeing every key and zeroed after: some kernels return NaN for a fully masked
    row, forward and backward (CUDA memory-efficient, pytorch#110213). Sinks: sink_as_first_key."""
    if output_attentions:
        _no_weights(output_attentions, "sdpa")
    value_dim = v.shape[-1]
    if sinks is not None:
        q, k, v, mask = sink_as_first_key(q, k, v, mask, sinks, scale)
    sq, sk = q.shape[2], k.shape[2]
    if mask is None and is_causal and sq != sk:  # SDPA's is_causal is top-left aligned, ours bottom-right
        mask = None if sq == 1 else causal_bool_mask(sq, sk, q.device)
        is_causal = False
    # A Python bool by a branch (dynamo guards on it; bool() would trace to a SymBool): SDPA takes no SymBool, and a
    # compiled step can hold the key heads as a symbol (a static cache compiled again after another model's, with
    # another key/value head count).
    gqa = True if q.shape[1] != k.shape[1] else False  # noqa: SIM210
    if gqa and q.device.type != "cpu" and not fused_kernels_take_grouped_heads(k, v, mask):  # the CPU's take all
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        gqa = False
    hidden = hidden_rows
    if mask is not None and hidden is None:
        hidden = ~visible_rows(mask)
        mask = unhidden(mask, hidden, q.dtype)
    elif mask is not None and mask.dtype != torch.bool:  # a bias derived in another dtype (autocast)
        mask = mask.to(q.dtype).clamp(min=torch.finfo(q.dtype).min)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                         is_causal=is_causal and mask is None, scale=scale, enable_gqa=gqa)
    out = out if hidden is None else out.masked_fill(hidden, 0.0)
    return (out if sinks is None else out[..., :value_dim]), None


def fused_kernels_take_grouped_heads(k, v, mask) -> bool:
    """Off the CPU, whether SDPA may get the key/value heads grouped (enable_gqa) rather than repeated. CUDA's flash
    and memory-efficient kernels refuse enable_gqa beside a mask, or with head dims over 256 or unequal: SDPA then
    falls back, silently, to the math kernel, which materializes every score in fp32 (transformers'
    use_gqa_in_sdpa, the same rule; pytorch#191085). The CPU's kernel takes every case."""
    return mask is None and k.shape[-1] == v.shape[-1] <= 256


def _no_weights(output_attentions: bool, backend: str) -> None:
    if output_attentions:
        raise ValueError(
            f"output_attentions=True needs the attention weights, which the {backend!r} backend does not compute; "
            "use attn_implementation='eager'"
        )


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
        check_triton_can_run(torch.device(device), dtype)


# ----------------------------------------------------------------------------------------------------------------
# Our backends as transformers' attention interface: attention modules call
# `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)(module, q, k, v, mask, scaling=...)`.
# ----------------------------------------------------------------------------------------------------------------

AttentionInterfaceFn = Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]


def as_attention_interface(backend: Callable[..., BackendOutput]) -> AttentionInterfaceFn:
    """One of our pure backends in transformers' attention-interface convention (module first, output
    [B, S, H, D]). Keyword arguments it does not use (sliding_window, position_ids, ...) are accepted and ignored:
    our masks already hold them, and their layout (masks.MaskLayout) travels as `layout`. s_aux: attention sinks,
    under transformers' name (official GPT-OSS passes it)."""

    def attention_forward(
        module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, is_causal=None,
        output_attentions=False, layout=None, s_aux=None, hidden_rows=None, **kwargs,
    ):
        extra = {} if hidden_rows is None else {"hidden_rows": hidden_rows}  # the flash backends take no mask
        out, weights = backend(
            query, key, value, attention_mask,
            scale=module.scaling if scaling is None else scaling,
            dropout_p=dropout,
            is_causal=getattr(module, "is_causal", False) if is_causal is None else is_causal,
            output_attentions=output_attentions,
            layout=layout,
            sinks=s_aux,
            **extra,
        )
        return out.transpose(1, 2), weights

    attention_forward.__name__ = attention_forward.__qualname__ = f"hf_tiny_{backend.__name__}_interface"
    return attention_forward


HF_TINY_INTERFACES: dict[str, AttentionInterfaceFn] = {
    name: as_attention_interface(backend) for name, backend in _BACKENDS.items()
}


# Our own backends, also under transformers' "paged|" prefix (our wrappers handle paged caches).
HF_TINY_BACKEND_NAMES = frozenset(HF_TINY_INTERFACES) | {f"paged|{name}" for name in HF_TINY_INTERFACES}
# Ours that apply the mask tensor itself (and take hidden_rows)
MASK_KERNEL_BACKENDS = frozenset({"eager", "sdpa", "paged|eager", "paged|sdpa"})


def is_hf_tiny_backend(name: str) -> bool:
    return name in HF_TINY_BACKEND_NAMES


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


def _register_hf_tiny_flash_masks() -> None:
    """transformers builds masks ahead of the forward (generate() with a static cache: create_masks_for_generate)
    only for names with a mask builder in its AttentionMaskInterface, and hands every other name None, which reads
    as "no padding": a left-padded batch would then attend to its padding. hf_tiny_flash takes the masks of
    flash_attention_2 (2-D padding masks, None without padding), so its builder is registered under its name, which
    no transformers model uses (transformers' own names keep their builders)."""
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionMaskInterface.register("hf_tiny_flash", flash_attention_mask)


_register_hf_tiny_flash_masks()
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


def check_takes_sinks(name: str, function: Callable) -> None:
    """Attention sinks reach an attention function as transformers' `s_aux`. A foreign function without that
    parameter (transformers' sdpa and paged ones: they take **kwargs) would drop them silently and compute attention
    without sinks, so it is refused. vLLM's takes them into its attention layer from the call's `s_aux=self.sinks`
    and fails loudly itself where it could not (its check_sinks)."""
    if name not in HF_TINY_INTERFACES and name != VLLM and not _takes_s_aux(function):
        raise ValueError(
            f"attn_implementation={name!r} does not take attention sinks (no `s_aux` parameter), which this model's "
            f"attention needs; use one that does: {sorted(HF_TINY_INTERFACES)}, or flex_attention on CUDA"
        )

"""Step preparation: a forward's arguments turned, once per forward, into what the layers read.

A model forward calls one function here first (`prepare_causal_step`, or the masks of the encoder and seq2seq
stacks) and hands its layers prepared values: the cache, the position ids, and one attention mask per layer type.
Everything about transformers' calling contract is read here and nowhere in the math: the two names of the cache
argument (`cache` from transformers 5.24 on, `past_key_values` before), the field name of outputs, the keyword
arguments of packing and continuous batching, the checks that turn a bad input into an error naming the field.

Masks have one representation, `AttentionMask(mask, is_causal, segment_ids)`: mask is None (plain causality or
nothing to mask, so that kernels take their fast path), a bool tensor [B, 1, Sq, Sk] (True = attend), or a float
tensor holding an additive bias (T5's relative buckets, ALiBi) with masked entries at the dtype's lowest value.

Padding rules, the same in every family and every backend: keys that are padding are never attended to; queries
are never masked for being padding. A padded query therefore sees the real tokens before it (right padding), as in
official transformers' eager and sdpa; a query that sees no key at all (left padding's pad positions in causal
attention) gives zeros, where official's kernels give the average of the values they were handed. Packed
(padding-free) rows hold several sequences one after the other: position_ids restarting at 0, or cu_seq_lens_q/k,
give the boundaries, no token attends across them, and `segment_ids` [B, S] travel with the mask for the kernels
that take boundaries instead of masks (flash varlen).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Union

import torch
from transformers.cache_utils import Cache, DynamicCache
from transformers.utils import ModelOutput

from .attention import causal_bool_mask, is_hf_tiny_backend
from .engines import interface_takes_mask

is_compiling = torch.compiler.is_compiling


class AttentionMask(NamedTuple):
    mask: Optional[torch.Tensor]
    is_causal: bool
    segment_ids: Optional[torch.Tensor] = None  # packed rows only: [B, S] sequence index of each token


# ---- the cache's two names, and the outputs' -----------------------------------------------------------------------


def is_paged_cache(cache) -> bool:
    """Continuous batching's paged cache (not a transformers Cache: its update takes the runner's kwargs)."""
    try:
        from transformers.generation.continuous_batching import PagedAttentionCache
    except ImportError:  # a transformers without continuous batching
        return False
    return isinstance(cache, PagedAttentionCache)


def cache_arguments(cache, past_key_values) -> tuple[Optional[Cache], object]:
    """(KV cache, paged cache) from forward's `cache` and `past_key_values` arguments, at most one of them set.
    transformers generates with `cache=` from 5.24 on and `past_key_values=` before; continuous batching passes its
    paged cache as `cache=` in every version."""
    if cache is not None and past_key_values is not None:
        raise ValueError(
            "pass the cache once: cache= (the name transformers uses from 5.24 on) or past_key_values= (before), "
            f"not both; got cache={type(cache).__name__} and past_key_values={type(past_key_values).__name__}"
        )
    given = past_key_values if cache is None else cache
    if given is None or isinstance(given, Cache):
        return given, None
    if is_paged_cache(cache):
        return None, cache
    raise TypeError(f"{'cache' if cache is not None else 'past_key_values'} must be a transformers Cache (e.g. "
                    f"DynamicCache, StaticCache, EncoderDecoderCache), got {type(given).__name__}")


def _cache_field() -> str:
    import dataclasses

    from transformers.modeling_outputs import BaseModelOutputWithPast

    names = {output_field.name for output_field in dataclasses.fields(BaseModelOutputWithPast)}
    return "cache" if "cache" in names else "past_key_values"


# The cache field of the installed transformers' output classes (all renamed together in 5.24): a constant, so that
# compiled forwards read no dataclass metadata.
CACHE_FIELD = _cache_field()


def with_cache(output_class: type, cache, **fields) -> ModelOutput:
    """output_class(**fields) with the cache under the field name the installed transformers declares."""
    return output_class(**fields, **{CACHE_FIELD: cache})


def cache_of(output) -> Optional[Cache]:
    """The cache a model output carries, under the field name the installed transformers declares."""
    return getattr(output, CACHE_FIELD)


# ---- outputs: flags, per-layer collections, tuples ------------------------------------------------------------------


@dataclass(frozen=True)
class OutputFlags:
    attentions: bool
    hidden_states: bool
    return_dict: bool


def output_flags(config, output_attentions=None, output_hidden_states=None, return_dict=None) -> OutputFlags:
    """The caller's choices, or the config's defaults; attention weights exist only in the 'eager' backend."""
    flags = OutputFlags(
        attentions=bool(config.output_attentions if output_attentions is None else output_attentions),
        hidden_states=bool(config.output_hidden_states if output_hidden_states is None else output_hidden_states),
        return_dict=bool(config.return_dict if return_dict is None else return_dict),
    )
    if flags.attentions and config._attn_implementation != "eager":
        raise ValueError(
            f"output_attentions=True needs the attention weights, which attn_implementation="
            f"{config._attn_implementation!r} does not compute; load the model with attn_implementation='eager' "
            "or call model.set_attn_implementation('eager') first"
        )
    return flags


class LayerOutputs(contextlib.AbstractContextManager):
    """What output_hidden_states / output_attentions (and MoE router logits) ask for, collected while a stack runs:
    hidden states as the model adds them, attention weights and router logits by forward hooks on the modules that
    return them (the layers return hidden states only, as transformers' do). A field not asked for stays None."""

    def __init__(self, flags: OutputFlags, *, attention_modules=(), routers=(), cross_attention_modules=()):
        self.hidden_states = () if flags.hidden_states else None
        self.attentions = self._recorded(attention_modules, 1) if flags.attentions else None
        self.cross_attentions = self._recorded(cross_attention_modules, 1) if flags.attentions else None
        # router logits feed the load-balancing loss: while gradients are recorded they must carry theirs
        self.router_logits = self._recorded(routers, 0, with_gradients=torch.is_grad_enabled()) if routers else None

    def _recorded(self, modules, index: int, with_gradients: bool = False) -> list:
        found = []

        def record(module, _args, output):
            if with_gradients and not output[index].requires_grad and any(p.requires_grad for p in module.parameters()):
                raise ValueError(
                    "output_router_logits: the router ran without gradients inside this forward, as reentrant gradient "
                    "checkpointing runs layers, so the load-balancing loss would train nothing; use "
                    "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
                    "(transformers' default) or output_router_logits=False"
                )
            found.append(output[index])

        record.records_outputs = True  # the runtime's recompute may replay a layer holding it (removed by then)
        self._handles = getattr(self, "_handles", [])
        self._handles += [module.register_forward_hook(record) for module in modules]
        return found

    def add_hidden(self, hidden_states: torch.Tensor) -> None:
        if self.hidden_states is not None:
            self.hidden_states += (hidden_states,)

    def __exit__(self, *exc) -> None:
        for handle in getattr(self, "_handles", ()):
            handle.remove()
        for name in ("attentions", "cross_attentions", "router_logits"):
            if getattr(self, name) is not None:
                setattr(self, name, tuple(getattr(self, name)))


def format_output(output: ModelOutput, return_dict: bool) -> Union[ModelOutput, tuple]:
    """The output as a ModelOutput, or as a tuple (None fields dropped) when return_dict is False."""
    return output if return_dict else output.to_tuple()


# ---- input checks -----------------------------------------------------------------------------------------------


def check_input_ids(input_ids: torch.Tensor, *, vocab_size: int, field: str = "input_ids") -> None:
    """int64 / int32 ids (nn.Embedding's index types) [batch, sequence], at least one token, inside the vocabulary."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{field} must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{field} must hold integer token ids, got dtype {input_ids.dtype}; pass int64 (or int32) "
                        f"ids: {field}.long()")
    if input_ids.dim() != 2 or 0 in input_ids.shape:
        raise ValueError(f"{field} must be 2-D [batch, sequence] with at least one token, got shape "
                         f"{tuple(input_ids.shape)}")
    if is_compiling():
        return  # data-dependent checks would break the graph; eager runs already checked the same code path
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{field} contains token id {low if low < 0 else high}, outside the vocabulary [0, {vocab_size})")


def check_inputs_embeds(inputs_embeds, *, hidden_size: int, field: str = "inputs_embeds") -> None:
    """Floating-point [batch, sequence, hidden_size] embeddings with at least one example and one position."""
    if not isinstance(inputs_embeds, torch.Tensor):
        raise TypeError(f"{field} must be a torch.Tensor [batch, sequence, hidden_size], got {type(inputs_embeds).__name__}")
    if not inputs_embeds.is_floating_point():
        raise TypeError(
            f"{field} must be floating-point embeddings [batch, sequence, hidden_size={hidden_size}], got dtype "
            f"{inputs_embeds.dtype} (token ids go in input_ids)"
        )
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size or 0 in inputs_embeds.shape[:2]:
        raise ValueError(
            f"{field} has shape {tuple(inputs_embeds.shape)}, but {field} must be [batch, sequence, "
            f"hidden_size={hidden_size}]"
        )


def check_token_inputs(config, input_ids: Optional[torch.Tensor], inputs_embeds: Optional[torch.Tensor], *,
                       names: tuple[str, str] = ("input_ids", "inputs_embeds")) -> tuple[int, int]:
    """Exactly one of ids / embeddings, checked; returns (batch, seq_len)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(f"pass exactly one of {names[0]} or {names[1]}")
    if input_ids is not None:
        check_input_ids(input_ids, vocab_size=config.vocab_size, field=names[0])
        return tuple(input_ids.shape[:2])
    check_inputs_embeds(inputs_embeds, hidden_size=config.hidden_size, field=names[1])
    return tuple(inputs_embeds.shape[:2])


def check_attention_mask(attention_mask, *, expected_shape: tuple, field: str = "attention_mask") -> None:
    """A 2-D padding mask must be [batch, keys] of 0/1 (bool or integer or float); 4-D masks pass through."""
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{field} must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask is None or attention_mask.dim() == 4:  # a 4-D mask is checked where it is read (ready_4d_mask)
        return
    if tuple(attention_mask.shape) != tuple(expected_shape):
        raise ValueError(f"{field} has shape {tuple(attention_mask.shape)} but the input needs {tuple(expected_shape)}")
    if attention_mask.is_complex():
        raise TypeError(f"{field} must be bool, integer or float 0/1, got dtype {attention_mask.dtype}")
    if attention_mask.dtype == torch.bool or is_compiling():
        return
    not_binary = (attention_mask != 0) & (attention_mask != 1)
    if bool(not_binary.any()):
        raise ValueError(f"{field} must hold 1 (real token) or 0 (padding); it holds {attention_mask[not_binary][0].item()!r}")


def check_sequence_length(length: int, *, limit: int, field: str = "sequence length",
                          limit_name: str = "max_position_embeddings") -> None:
    if length > limit:
        raise ValueError(f"{field} {length} exceeds {limit_name}={limit}")


def check_cache_matches(cache, *, batch_size: int, num_key_value_heads: int, head_dim: int) -> None:
    """A filled cache must come from a model of the same KV heads / head_dim and hold the same batch."""
    layers = getattr(cache, "layers", None)
    keys = getattr(layers[0], "keys", None) if layers else None
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.numel() == 0:
        return
    expected = {"batch size": batch_size, "key/value heads": num_key_value_heads, "head_dim": head_dim}
    found = {"batch size": keys.shape[0], "key/value heads": keys.shape[1], "head_dim": keys.shape[3]}
    wrong = [f"{name} {found[name]} (expected {value})" for name, value in expected.items() if found[name] != value]
    if wrong:
        raise ValueError(
            f"the cache (cache=, or past_key_values= before transformers 5.24) holds keys of shape "
            f"{tuple(keys.shape)}: {', '.join(wrong)}; it comes from another model or another batch. Pass the cache "
            "this model returned for this batch, or a fresh DynamicCache"
        )


def check_positions(position_ids, batch_size: int, query_length: int) -> torch.Tensor:
    """position_ids: integers, [query_length] or [1 | batch, query_length], never negative. Rotary positions have
    no upper limit (the rotation exists for any position; scaled rope types exist to run past the trained length)."""
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be a torch.Tensor of integers, got {type(position_ids).__name__}")
    if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must hold integer positions, got dtype {position_ids.dtype}")
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch_size) or position_ids.shape[1] != query_length:
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)} but the input needs [{batch_size}, {query_length}] "
            f"(or [1, {query_length}])"
        )
    if not is_compiling() and position_ids.numel() and int(position_ids.min()) < 0:
        raise ValueError(f"position_ids must be >= 0; got {int(position_ids.min())}")
    return position_ids


def check_skip_logits(skip_logits: Optional[bool], labels) -> None:
    if skip_logits and labels is None:
        raise ValueError("skip_logits=True needs labels: without them there is no loss and the logits are the output")


def check_extra_kwargs(owner: str, kwargs: dict, allowed: tuple, ignored: tuple = ()) -> dict:
    """The keyword arguments a forward takes besides its named ones; anything else is an error (silently ignoring,
    say, packed-sequence boundaries would attend across sequences)."""
    unknown = sorted(k for k in kwargs if k not in allowed and k not in ignored)
    if unknown:
        raise TypeError(f"{owner}.forward() got unexpected keyword argument(s) {unknown}; accepted extras: {list(allowed)}")
    return {k: v for k, v in kwargs.items() if k in allowed}


# ---- masks ----------------------------------------------------------------------------------------------------------

# An additive mask value at or below this is "masked": exp(-1e4) is 0 in every dtype (the oldest convention,
# BERT's -10000.0, and finfo.min both qualify). Values between it and 0 are biases, which a bool mask cannot hold.
_MASKED_AT_OR_BELOW = -1e4


def ready_4d_mask(attention_mask: torch.Tensor, *, query_length: int, key_length: int) -> torch.Tensor:
    """A caller's 4-D mask: bool (True = attend) as it is, float additive (0 = attend, large negative = masked,
    e.g. transformers' eager masks) as a bool, integer 1/0 as a bool."""
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
                    "additive bias through step.with_position_bias, or a bool mask"
                )
        return attend
    return attention_mask != 0


def self_attention_mask(attention_mask, *, batch_size: int, query_length: int, key_length: int, causal: bool,
                        sliding_window: Optional[int] = None, device: torch.device) -> AttentionMask:
    """Self-attention of query_length new tokens over key_length keys (cached + new), aligned bottom-right;
    attention_mask None, 2-D [B, key_length] 1/0, or a ready 4-D mask; a query sees the last sliding_window keys."""
    _check_self_attention(attention_mask, batch_size, query_length, key_length, causal, sliding_window)
    if attention_mask is not None and attention_mask.dim() == 4:
        return AttentionMask(ready_4d_mask(attention_mask, query_length=query_length, key_length=key_length), causal)
    return _self_attention(attention_mask, batch_size, query_length, key_length, causal, sliding_window, device)


def _self_attention(attention_mask, batch_size: int, query_length: int, key_length: int, causal: bool,
                    sliding_window: Optional[int], device) -> AttentionMask:
    """self_attention_mask for checked arguments and a 2-D mask or none."""
    # under torch.compile the padding mask is always applied: no branch on the data
    padded = attention_mask is not None and (is_compiling() or not bool(attention_mask.all()))
    windowed = causal and sliding_window is not None and key_length > sliding_window
    if not padded and not windowed and (not causal or query_length in (1, key_length)):
        return AttentionMask(None, causal and query_length > 1)
    if causal:
        mask = causal_bool_mask(query_length, key_length, device, window=sliding_window if windowed else None)
    else:
        mask = torch.ones(query_length, key_length, dtype=torch.bool, device=device)
    mask = mask[None, None].expand(batch_size, 1, query_length, key_length)
    if padded:
        mask = mask & attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    return AttentionMask(mask, causal)


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
    """The bidirectional mask `mask` limited to keys at most `reach` positions from the query."""
    if length <= reach + 1:  # every key is within reach
        return mask
    positions = torch.arange(length, device=device)
    near = (positions[:, None] - positions[None, :]).abs() <= reach
    if mask.mask is None:
        return AttentionMask(near[None, None].expand(batch_size, 1, length, length), False)
    return AttentionMask(mask.mask & near, False)


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
        return AttentionMask(ready_4d_mask(encoder_attention_mask, query_length=query_length, key_length=key_length), False)
    if encoder_attention_mask.dim() != 2:
        raise ValueError(
            f"encoder_attention_mask must be 2-D [batch, encoder_length]; got shape {tuple(encoder_attention_mask.shape)}"
        )
    if not is_compiling() and bool(encoder_attention_mask.all()):  # no padding (compiled: always the mask)
        return AttentionMask(None, False)
    batch, key_length = encoder_attention_mask.shape
    return AttentionMask(encoder_attention_mask.to(torch.bool)[:, None, None, :].expand(batch, 1, query_length, key_length), False)


def _broadcasts(*shapes) -> bool:
    try:
        torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return False
    return True


def with_position_bias(mask: AttentionMask, bias: torch.Tensor, dtype: torch.dtype) -> AttentionMask:
    """Folds an additive position bias (T5 relative buckets, ALiBi; [1|B, H, Sq, Sk]) and the mask into one float
    mask."""
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
    own for the kernels that read segment ids."""
    if chunk_size is not None:
        segment_ids = _split_at_chunks(segment_ids, chunk_size)
    seq = segment_ids.shape[-1]
    mask = causal_bool_mask(seq, seq, segment_ids.device)
    if sliding_window is not None:
        rows = torch.arange(seq, device=segment_ids.device)[:, None]
        mask = mask & (rows - torch.arange(seq, device=segment_ids.device)[None, :] < sliding_window)
    same_sequence = segment_ids[:, :, None] == segment_ids[:, None, :]
    return AttentionMask((mask[None] & same_sequence)[:, None], True, segment_ids)


def static_cache_mask(attention_mask, past_length, key_offset, key_length: int, batch_size: int, query_length: int,
                      window: Optional[int], device: torch.device) -> AttentionMask:
    """Causal bool mask [B, 1, Sq, key_length] for caches whose keys are not simply the last keys (static caches).
    Key slot j holds absolute position key_offset + j; query i sits at absolute position past_length + i. Slots not
    filled yet lie after the newest position, so causality masks them. Tensor ops only (past_length may be a 0-d
    tensor), so it compiles without graph breaks."""
    query_pos = (torch.arange(query_length, device=device) + past_length)[:, None]
    key_pos = (torch.arange(key_length, device=device) + key_offset)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    mask = mask[None, None].expand(batch_size, 1, query_length, key_length)
    if attention_mask is not None:
        valid = attention_mask.to(device=device, dtype=torch.bool)
        known = valid.shape[-1]
        key_valid = valid[:, key_pos[0].clamp(max=known - 1)] & (key_pos[0] < known)[None, :]
        mask = mask & key_valid[:, None, None, :]
    return AttentionMask(mask, True)


# ---- the causal step ------------------------------------------------------------------------------------------------

# Keyword arguments a causal forward takes besides its named ones.
# Sequence boundaries of a packed (padding-free) row, as DataCollatorWithFlattening(return_flash_attn_kwargs=True)
# and TRL's padding-free collator (seq_idx: each token's sequence) pass them (transformers' TransformersKwargs);
# without them the boundaries are read from restarting position_ids.
PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# transformers' continuous batching: every request's new tokens flattened into one row, the paged cache (cache=)
# filled by the attention modules through these indices; before 5.2x the longest sequences are max_seqlen_q / _k.
PAGED_KWARGS = ("read_index", "write_index", "block_table", "is_causal", "logits_indices", "logits_processor_args",
                "max_seqlen_q", "max_seqlen_k")
# Read by continuous batching itself, never by the model (it slices the logits at logits_indices after forward).
PAGED_RUNNER_ONLY = ("logits_indices", "logits_processor_args", "is_causal")
# transformers before 5.23 passes cache_position from generate(); positions come from position_ids / the cache.
# num_items_in_batch (a TransformersKwargs key, Trainer's loss normalizer) means nothing to a model without a loss.
IGNORED_KWARGS = ("cache_position", "num_items_in_batch")


@dataclass
class CausalStep:
    """What a causal model's layers read in one forward: the cache (a transformers Cache, continuous batching's
    paged cache, or None), the position ids, one mask per layer type, and the keyword arguments the attention
    functions take (continuous batching's indices)."""

    cache: object
    position_ids: torch.Tensor
    masks: dict
    flags: OutputFlags
    attention_kwargs: dict = field(default_factory=dict)
    paged: bool = False
    past_length: object = 0  # tokens the cache held before this forward (int, or a 0-d tensor under torch.compile)

    @property
    def returned_cache(self):
        """The cache the output carries: the KV cache; never continuous batching's paged cache (the runner's)."""
        return None if self.paged else self.cache

    def token_indices(self) -> torch.Tensor:
        """[1, S]: each new token's index in its row of the cache, past_length + 0 .. S - 1, whatever the position
        ids say (left padding counts); under continuous batching, each request's position ids."""
        if self.paged:
            return self.position_ids
        length = self.position_ids.shape[-1]
        return (torch.arange(length, device=self.position_ids.device) + self.past_length).unsqueeze(0)


def prepare_causal_step(model, input_ids, inputs_embeds, attention_mask, position_ids, cache, past_key_values,
                        use_cache, flags: OutputFlags, kwargs: dict) -> CausalStep:
    """Checks a causal forward's arguments and prepares its cache, positions and masks (model: the base model, for
    its config, its training state and its cache-less defaults)."""
    extras = check_extra_kwargs(type(model).__name__, kwargs, PACKING_KWARGS + PAGED_KWARGS, IGNORED_KWARGS)
    cache, paged_cache = cache_arguments(cache, past_key_values)
    batch_size, query_length = check_token_inputs(model.config, input_ids, inputs_embeds)
    if paged_cache is not None or any(k in extras for k in PAGED_KWARGS if k not in PAGED_RUNNER_ONLY):
        return _paged_step(model, attention_mask, position_ids, paged_cache, flags, extras)
    cache = _cache_to_fill(model, cache, use_cache, batch_size)
    past_length = cache.get_seq_length() if cache is not None else 0
    device = (input_ids if input_ids is not None else inputs_embeds).device
    shape = CausalShape(batch_size, query_length, past_length, device)
    if attention_mask is not None and not isinstance(attention_mask, dict) and not is_compiling():
        check_attention_mask(attention_mask, expected_shape=(batch_size, int(past_length) + query_length))
    segment_ids = None
    if position_ids is not None or extras:  # packed rows announce themselves by their positions or boundaries
        position_ids = None if position_ids is None else check_positions(position_ids, batch_size, query_length)
        segment_ids = packed_segments(position_ids, attention_mask, cache, shape, extras)
    if position_ids is None:
        position_ids = (torch.arange(query_length, device=device) + past_length).unsqueeze(0)
    masks = causal_masks(model, attention_mask, cache, shape, segment_ids)
    return CausalStep(cache, position_ids, masks, flags, past_length=past_length)


def _cache_to_fill(model, cache, use_cache: Optional[bool], batch_size: int):
    """The given cache (checked to fit), a new DynamicCache, or none: a training step builds no cache unless asked
    (its layers are recomputed in backward), nor does a gradient-checkpointed one."""
    if cache is not None:
        if not is_compiling():
            heads, dim = model.cache_layout
            check_cache_matches(cache, batch_size=batch_size, num_key_value_heads=heads, head_dim=dim)
        return cache
    if use_cache is None:
        use_cache = model.config.use_cache and not (model.training and torch.is_grad_enabled())
    checkpointed = model.gradient_checkpointing and model.training
    return DynamicCache(config=model.config) if use_cache and not checkpointed else None


@dataclass(frozen=True)
class CausalShape:
    batch_size: int
    query_length: int
    past_length: object  # int, or a 0-d tensor under torch.compile
    device: torch.device


def packed_segments(position_ids, attention_mask, cache, shape: CausalShape, extras: dict) -> Optional[torch.Tensor]:
    """Sequence index of each token when the row holds several packed sequences (no padding mask, no cached
    tokens): from cu_seq_lens_q/k when given, else from restarting (given) position_ids. None otherwise."""
    cu_q, cu_k, seq_idx = extras.get("cu_seq_lens_q"), extras.get("cu_seq_lens_k"), extras.get("seq_idx")
    if cu_q is not None or cu_k is not None or seq_idx is not None:
        if shape.past_length or attention_mask is not None:
            raise ValueError(
                "cu_seq_lens_q/cu_seq_lens_k/seq_idx describe packed sequences of one forward without padding; they "
                f"cannot be combined with cached tokens ({int(shape.past_length)}) or an attention_mask"
            )
        if cu_q is None and cu_k is None:
            return segment_ids_from_seq_idx(seq_idx, batch_size=shape.batch_size, length=shape.query_length)
        if cu_q is not None and cu_k is not None and not torch.equal(cu_q.cpu(), cu_k.cpu()):
            raise ValueError(
                f"cu_seq_lens_q={cu_q.tolist()} and cu_seq_lens_k={cu_k.tolist()} must be equal in self-attention "
                "without a cache"
            )
        name = "cu_seq_lens_q" if cu_q is not None else "cu_seq_lens_k"
        return segment_ids_from_cu_seq_lens(cu_q if cu_q is not None else cu_k, batch_size=shape.batch_size,
                                            length=shape.query_length, field=name)
    static = cache is not None and getattr(cache, "is_compileable", False)
    if position_ids is None or attention_mask is not None or static or (not is_compiling() and int(shape.past_length)):
        return None
    return segment_ids_from_position_ids(position_ids.expand(shape.batch_size, -1))


def causal_masks(model, attention_mask, cache, shape: CausalShape, segment_ids) -> dict:
    """{layer type: AttentionMask} for every layer type of the model (full, sliding), built once per forward; with
    ALiBi's distance bias folded in; none for functions that mask by their own metadata (vLLM's)."""
    config, implementation = model.config, model.config._attn_implementation
    layer_types = dict.fromkeys(config.layer_types)
    if not is_hf_tiny_backend(implementation) and not interface_takes_mask(implementation):
        refuse_alibi(config, f"attn_implementation={implementation!r}")
        return {layer_type: AttentionMask(None, True) for layer_type in layer_types}
    by_type = _masks_by_layer_type(config, attention_mask) if isinstance(attention_mask, dict) else None
    masks = {}
    for layer_type in layer_types:
        window = config.sliding_window if layer_type == "sliding_attention" else None
        chunk = config.chunked_attention.attention_chunk_size if layer_type == "chunked_attention" else None
        if segment_ids is not None:
            masks[layer_type] = packed_causal_mask(segment_ids, sliding_window=window, chunk_size=chunk)
            continue
        given = attention_mask if by_type is None else by_type[layer_type]
        layer_idx = config.layer_types.index(layer_type)
        masks[layer_type] = causal_mask(given, cache, shape, window, layer_idx=layer_idx)
        if chunk is not None and (given is None or given.dim() == 2):  # a 4-D mask is complete as given
            masks[layer_type] = _chunked_layer_mask(masks[layer_type], given, cache, shape, chunk, layer_idx)
    if config.position_embedding_type == "alibi":
        dtype = model.get_input_embeddings().weight.dtype
        masks = {kind: _with_alibi(config, mask, cache, shape, kind, dtype) for kind, mask in masks.items()}
    return masks


def _masks_by_layer_type(config, attention_mask: dict) -> dict:
    """A dict attention_mask ({layer type: 4-D mask or None}, as generate() prepares for static caches of models
    with layer_types) checked to cover every layer type."""
    missing = sorted(set(config.layer_types) - set(attention_mask))
    for layer_type, mask in attention_mask.items():
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 4):
            missing.append(f"{layer_type} (not a 4-D tensor)")
    if missing:
        raise ValueError(
            f"attention_mask given per layer type (keys {sorted(attention_mask)}) needs a 4-D mask or None for every "
            f"layer type of this model {sorted(set(config.layer_types))}; wrong or missing: {missing}"
        )
    return attention_mask


def key_layout(cache: Optional[Cache], shape: CausalShape, layer_idx: int):
    """(key_length, key_offset): the keys layer `layer_idx` attends to after its cache update are the absolute
    positions key_offset .. key_offset + key_length - 1 (a static cache also holds unfilled slots, a sliding layer's
    cache only the last window)."""
    if cache is None:
        return shape.past_length + shape.query_length, 0
    return cache.get_mask_sizes(shape.query_length, layer_idx)


def causal_mask(attention_mask, cache, shape: CausalShape, window: Optional[int], *, layer_idx: int) -> AttentionMask:
    """The mask of the layers of one type: `window` is their sliding window (None: full causal), `layer_idx` the
    first such layer (its cache tells which keys they hold)."""
    key_length, key_offset = key_layout(cache, shape, layer_idx)
    if attention_mask is not None and attention_mask.dim() == 4:
        return self_attention_mask(attention_mask, batch_size=shape.batch_size, query_length=shape.query_length,
                                   key_length=key_length, causal=True, device=shape.device)
    if cache is None or not getattr(cache, "is_compileable", False):
        # Dynamic caches return exactly the keys at positions key_offset .. past + new - 1: causality is bottom-right
        # aligned and the padding mask's last key_length columns belong to them.
        if attention_mask is not None:
            attention_mask = attention_mask[:, attention_mask.shape[-1] - key_length :]
        return _self_attention(attention_mask, shape.batch_size, shape.query_length, key_length, True, window, shape.device)
    return static_cache_mask(attention_mask, shape.past_length, key_offset, key_length, shape.batch_size,
                             shape.query_length, window, shape.device)


def _chunked_layer_mask(mask: AttentionMask, attention_mask, cache, shape: CausalShape, chunk_size: int,
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
    base = mask.mask
    if base is None:
        sq, sk = len(queries), len(keys)
        base = causal_bool_mask(sq, sk, queries.device) if mask.is_causal else torch.ones(sq, sk, dtype=torch.bool, device=queries.device)
    return AttentionMask(base & same_chunk[:, None], mask.is_causal, mask.segment_ids)


def refuse_alibi(config, where: str) -> None:
    if config.position_embedding_type == "alibi":
        raise ValueError(
            f"ALiBi adds a distance bias to the attention scores through the mask, which {where} does not take; use "
            "attn_implementation='sdpa' or 'eager'"
        )


def _with_alibi(config, mask: AttentionMask, cache, shape: CausalShape, layer_type: str, dtype) -> AttentionMask:
    """The layer type's mask with ALiBi's distance bias folded in (queries at past_length .., keys where the cache
    holds them after the update)."""
    key_length, key_offset = key_layout(cache, shape, config.layer_types.index(layer_type))
    queries = torch.arange(shape.query_length, device=shape.device) + shape.past_length
    keys = torch.arange(key_length, device=shape.device) + key_offset
    slopes = alibi_slopes(config.num_attention_heads, config.alibi_bias.alibi_bias_max)
    return with_position_bias(mask, alibi_bias(slopes, queries, keys), dtype)


def _paged_step(model, attention_mask, position_ids, paged_cache, flags: OutputFlags, extras: dict) -> CausalStep:
    """One step of transformers' continuous batching: every request's new tokens in one row, position_ids restarting
    per request, masks ready per layer type (None when the attention function reads the boundaries itself), and
    the paged cache, which the attention modules fill through the indices in attention_kwargs."""
    config = model.config
    orphans = sorted(k for k in PAGED_KWARGS if k in extras and k not in PAGED_RUNNER_ONLY)
    if paged_cache is None and orphans:
        raise TypeError(
            f"{type(model).__name__}.forward() got {orphans} without cache=: these belong to transformers' "
            "continuous batching and describe its paged cache (pass that as cache=), or drop them"
        )
    refuse_alibi(config, "continuous batching (a paged cache)")
    if position_ids is None:
        raise ValueError("continuous batching (a paged `cache`) needs position_ids for the flattened requests")
    is_causal = bool(extras.get("is_causal", False))
    masks = {}
    for layer_type in dict.fromkeys(config.layer_types):
        mask = attention_mask.get(layer_type) if isinstance(attention_mask, dict) else attention_mask
        masks[layer_type] = AttentionMask(mask, is_causal)
    attention_kwargs = {k: v for k, v in extras.items() if k not in PAGED_RUNNER_ONLY}
    flags = OutputFlags(False, flags.hidden_states, True)
    return CausalStep(paged_cache, position_ids, masks, flags, attention_kwargs, paged=True)

"""Step preparation: a forward's arguments turned, once per forward, into what the layers read.

A model forward calls one function here first (`prepare_causal_step`, or the checks and masks.py's masks of the
encoder and seq2seq stacks) and hands its layers prepared values: the cache, the position ids, and one attention
mask per layer type (masks.py: each with its layout declared). Everything about transformers' calling contract is
read here and nowhere in the math: the two names of the cache argument (`cache` from transformers 5.24 on,
`past_key_values` before), the field name of outputs, the keyword arguments of packing and continuous batching, the
checks that turn a bad input into an error naming the field.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from transformers.cache_utils import Cache, DynamicCache
from transformers.utils import ModelOutput

from .attention import MASK_KERNEL_BACKENDS, is_hf_tiny_backend
from .engines import check_block_mask, interface_takes_mask, is_block_mask
from .masks import (
    AttentionMask, CausalShape, alibi_mask, causal_mask, chunked_layer_mask, packed_causal_mask, refuse_alibi,
    refuse_chunked_layers, with_hidden_rows,
    segment_ids_from_cu_seq_lens, segment_ids_from_position_ids, segment_ids_from_seq_idx,
)

is_compiling = torch.compiler.is_compiling


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
        self._handles += _registered_outside_the_graph(modules, record)
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


@torch.compiler.disable(reason=(
    "output_attentions / output_router_logits record layer outputs with forward hooks registered for that forward, "
    "which torch.compile(fullgraph=True) cannot do; compile with fullgraph=False (transformers' CompileConfig "
    "default: the hooks are registered between graphs), or ask for these outputs from an uncompiled forward"))
def _registered_outside_the_graph(modules, hook) -> list:
    """The hook on each module; under torch.compile a graph break (in a fullgraph compile, an error giving the reason)."""
    return [module.register_forward_hook(hook) for module in modules]


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
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one wait on the device, not two
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{field} contains token id {low if low < 0 else high}, outside the vocabulary [0, {vocab_size})")


def check_inputs_embeds(inputs_embeds, *, width: int, width_name: str = "hidden_size",
                        field: str = "inputs_embeds") -> None:
    """Floating-point [batch, sequence, width] embeddings with at least one example and one position; width_name
    says which config field the width is (embedding_size where the embeddings are projected to hidden_size)."""
    if not isinstance(inputs_embeds, torch.Tensor):
        raise TypeError(f"{field} must be a torch.Tensor [batch, sequence, {width_name}={width}], got {type(inputs_embeds).__name__}")
    if not inputs_embeds.is_floating_point():
        raise TypeError(
            f"{field} must be floating-point embeddings [batch, sequence, {width_name}={width}], got dtype "
            f"{inputs_embeds.dtype} (token ids go in input_ids)"
        )
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != width or 0 in inputs_embeds.shape[:2]:
        raise ValueError(
            f"{field} has shape {tuple(inputs_embeds.shape)}, but {field} must be [batch, sequence, "
            f"{width_name}={width}]"
        )


def check_token_inputs(config, input_ids: Optional[torch.Tensor], inputs_embeds: Optional[torch.Tensor], *,
                       names: tuple[str, str] = ("input_ids", "inputs_embeds"),
                       embedding_width: str = "hidden_size") -> tuple[int, int]:
    """Exactly one of ids / embeddings, checked; returns (batch, seq_len). embedding_width: the config field that
    inputs_embeds' width must equal (the width of get_input_embeddings()'s vectors)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(f"pass exactly one of {names[0]} or {names[1]}")
    if input_ids is not None:
        check_input_ids(input_ids, vocab_size=config.vocab_size, field=names[0])
        return tuple(input_ids.shape[:2])
    check_inputs_embeds(inputs_embeds, width=getattr(config, embedding_width), width_name=embedding_width, field=names[1])
    return tuple(inputs_embeds.shape[:2])


def check_attention_mask(attention_mask, *, expected_shape: tuple, field: str = "attention_mask",
                         wider_ok: bool = False) -> None:
    """A 2-D padding mask must be [batch, keys] of 0/1 (bool or integer or float); 4-D masks pass through.
    wider_ok (a static cache's forward): it may be wider, as transformers reads it: column c is position c, and the
    columns after the newest token (the cache's empty slots) are not read."""
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{field} must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask is None or attention_mask.dim() == 4:  # a 4-D mask is checked where it is read (ready_4d_mask)
        return
    batch, keys = expected_shape
    fits = attention_mask.dim() == 2 and attention_mask.shape[0] == batch and (
        attention_mask.shape[1] == keys or wider_ok and attention_mask.shape[1] > keys)
    if not fits:
        wider = " or wider (a static cache: column c is position c)" if wider_ok else ""
        raise ValueError(f"{field} has shape {tuple(attention_mask.shape)} but the input needs {tuple(expected_shape)}"
                         f"{wider}")
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


def check_static_cache_room(cache, past_length, query_length: int) -> None:
    """A static cache's full-attention layers hold max_cache_len positions: an input that would write past them is
    refused naming the sizes. (The cache's own write fails with an index error; on CUDA, with a device-side assert
    that ends the process's use of the GPU.) Sliding-window layers keep their last window and take any length."""
    for layer in getattr(cache, "layers", ()):
        if getattr(layer, "is_sliding", True) or not isinstance(getattr(layer, "max_cache_len", None), int):
            continue
        filled = int(past_length)
        if filled + query_length > layer.max_cache_len:
            raise ValueError(
                f"the static cache holds {layer.max_cache_len} positions (max_cache_len), {filled} of them filled, "
                f"and this input adds {query_length}: {filled + query_length} do not fit. Pass a StaticCache with "
                f"max_cache_len >= {filled + query_length}, or a DynamicCache"
            )
        return


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
# a forward with any of them is paged (a frozenset's isdisjoint: dynamo traces it, not dict_keys')
PAGED_MODEL_KWARGS = frozenset(PAGED_KWARGS) - frozenset(PAGED_RUNNER_ONLY)
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
    if paged_cache is not None or (extras and not PAGED_MODEL_KWARGS.isdisjoint(extras)):
        return _paged_step(model, attention_mask, position_ids, paged_cache, flags, extras)
    cache = _cache_to_fill(model, cache, use_cache, batch_size)
    past_length = cache.get_seq_length() if cache is not None else 0
    if cache is not None and cache.is_compileable and not is_compiling():
        check_static_cache_room(cache, past_length, query_length)
    device = (input_ids if input_ids is not None else inputs_embeds).device
    shape = CausalShape(batch_size, query_length, past_length, device)
    if is_block_mask(attention_mask):
        check_block_mask(model.config._attn_implementation, "attention_mask")
    elif attention_mask is not None and not isinstance(attention_mask, dict) and not is_compiling():
        check_attention_mask(attention_mask, expected_shape=(batch_size, int(past_length) + query_length),
                             wider_ok=cache is not None and cache.is_compileable)
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
    # an attribute read, not getattr with a default: dynamo guards a compiled step on such a getattr by calling the
    # property in Python at every call (one call per cache layer)
    static = cache is not None and cache.is_compileable
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
        refuse_chunked_layers(config, f"attn_implementation={implementation!r}")
        return {layer_type: AttentionMask(None, True) for layer_type in layer_types}
    by_type = _masks_by_layer_type(config, attention_mask, shape) if isinstance(attention_mask, dict) else None
    masks = {}
    for layer_type in layer_types:
        window = config.sliding_window if layer_type == "sliding_attention" else None
        chunk = config.chunked_attention.attention_chunk_size if layer_type == "chunked_attention" else None
        given = attention_mask if by_type is None else by_type[layer_type]
        if is_block_mask(given):  # flex_attention's, complete as built (window, chunks and padding included)
            refuse_alibi(config, "a flex_attention BlockMask")
            masks[layer_type] = AttentionMask(given, False)
            continue
        if segment_ids is not None:
            masks[layer_type] = packed_causal_mask(segment_ids, sliding_window=window, chunk_size=chunk)
            continue
        layer_idx = config.layer_types.index(layer_type)
        masks[layer_type] = causal_mask(given, cache, shape, window, layer_idx=layer_idx)
        if chunk is not None and (given is None or given.dim() == 2):  # a 4-D mask is complete as given
            masks[layer_type] = chunked_layer_mask(masks[layer_type], given, cache, shape, chunk, layer_idx)
    if config.position_embedding_type == "alibi":
        dtype = model.get_input_embeddings().weight.dtype
        masks = {kind: alibi_mask(config, mask, cache, shape, kind, dtype) for kind, mask in masks.items()}
    if implementation in MASK_KERNEL_BACKENDS:  # each of their layers would otherwise derive the rows itself
        masks = {kind: with_hidden_rows(mask) for kind, mask in masks.items()}
    return masks


# generate() with a static cache asks the model for its masks before each step; these backends build them in the forward
# (transformers has no builder for the "paged|" names: its create_masks_for_generate gives them no mask, the padding lost)
MASKS_BUILT_IN_THE_FORWARD = MASK_KERNEL_BACKENDS


def masks_for_generate(*, config, inputs_embeds, attention_mask, **kwargs):
    """What the causal LM's create_masks_for_generate returns. generate() calls it before each forward when the cache
    is compileable (a static cache), so that a compiled step sees masks of one shape at every position; transformers'
    own builds 4-D masks there, outside the compiled step, which on a GPU leaves their Python (256 of the 860 calls
    of a captured decoding step of a 22-layer Llama) and their kernels outside the CUDA graph. For the backends whose
    masks the forward builds (MASKS_BUILT_IN_THE_FORWARD) the 2-D padding mask goes on instead, padded to the static
    cache's length as transformers pads it (column c stays position c; masks.causal_mask), and the masks are built
    inside the step (chunked layers too: transformers 5.16-5.19's builder fails on them, a TypeError official Llama 4
    meets). Models without full-attention layers (no layer's keys span the cache's length), and every other backend,
    get transformers' masks."""
    cache = kwargs["cache"] if "cache" in kwargs else kwargs.get("past_key_values")  # its name from 5.24 on, before
    layer_types = config.layer_types
    if (config._attn_implementation not in MASKS_BUILT_IN_THE_FORWARD or "full_attention" not in layer_types
            or not isinstance(cache, Cache) or not cache.is_compileable
            or (attention_mask is not None and attention_mask.dim() != 2)):
        from transformers.masking_utils import create_masks_for_generate

        return create_masks_for_generate(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                         **kwargs)
    if attention_mask is None:  # no padding: the forward's masks are causal
        return None
    keys, _ = cache.get_mask_sizes(inputs_embeds.shape[1], layer_types.index("full_attention"))
    missing = keys - attention_mask.shape[-1]  # none when the tokens overflow the cache (whose update then refuses)
    return torch.nn.functional.pad(attention_mask, (0, missing)) if missing > 0 else attention_mask


def _masks_by_layer_type(config, attention_mask: dict, shape: CausalShape) -> dict:
    """A dict attention_mask, {layer type: mask}, as generate() prepares it for static caches of models with
    layer_types (transformers' create_masks_for_generate), checked to cover every layer type. Its masks have the
    layouts of transformers' mask builders: 4-D masks (eager, sdpa), BlockMasks (flex_attention), or for flash
    attention 2-D padding masks, the last columns of generate's attention_mask that the layer's keys reach
    (flash_attention_mask), or None (no padding among them). A 2-D one is a 2-D attention_mask (masks.causal_mask:
    its last column is the newest token)."""
    missing = sorted(set(config.layer_types) - set(attention_mask))
    for layer_type, mask in attention_mask.items():
        field = f"attention_mask[{layer_type!r}]"
        if mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 4):
            continue
        if is_block_mask(mask):
            check_block_mask(config._attn_implementation, field)
            continue
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            _check_layer_padding_mask(mask, shape, field, full=layer_type == "chunked_attention")
        elif isinstance(mask, torch.Tensor):
            missing.append(f"{field} is a {mask.dim()}-D tensor of shape {tuple(mask.shape)}")
        else:
            missing.append(f"{field} is a {type(mask).__name__}")
    if missing:
        raise ValueError(
            f"attention_mask given per layer type (keys {sorted(attention_mask)}) needs, for every layer type of this "
            f"model {sorted(set(config.layer_types))}, a 4-D mask, a 2-D padding mask, a BlockMask (flex_attention) "
            f"or None; wrong or missing: {missing}"
        )
    return attention_mask


def _check_layer_padding_mask(mask: torch.Tensor, shape: CausalShape, field: str, *, full: bool) -> None:
    """A layer type's 2-D padding mask: [batch, keys] of 0/1 whose last column is the newest token, covering at most
    the past and new tokens (fewer: the last ones, as transformers slices it for a sliding layer). Chunks count from
    each row's first real token, so a chunked layer's mask covers them all (transformers cuts none: it refuses flash
    attention once a chunked layer's keys span more than one chunk)."""
    if is_compiling():
        return
    total = int(shape.past_length) + shape.query_length
    batch, width = mask.shape
    if batch != shape.batch_size or not 1 <= width <= total or (full and width != total):
        needs = f"({shape.batch_size}, {total})" if full else f"({shape.batch_size}, K) with 1 <= K <= {total}"
        raise ValueError(f"{field} has shape {tuple(mask.shape)} but the input needs {needs} (the past and new tokens)")
    check_attention_mask(mask, expected_shape=tuple(mask.shape), field=field)


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

"""The Llama-style causal LM family: pre-norm RMSNorm blocks, rotary self-attention (GQA/MQA), SwiGLU; the config
chooses the parts other decoders differ in (per-layer full / sliding attention with per-type RoPE, Gemma 3's norms
and scales, GPT-2's learned positions, LayerNorm and plain MLP), never a copy of the model.

Parameter names are Llama's (model.embed_tokens, model.layers.N.self_attn.q_proj, mlp.gate_proj, input_layernorm,
post_attention_layernorm, model.norm, lm_head), so PEFT target_modules, tensor-parallel plans and GGUF name maps
work by habit. Generation goes through transformers' GenerationMixin and Cache API (DynamicCache, StaticCache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    SequenceClassifierOutputWithPast,
)

from .configuration_causal import TinyCausalConfig
from .overwrite import layer_workspace
from .attention import interface_takes_mask
from .chunked_loss import labels_ahead, linear_cross_entropy, use_chunked_loss
from .layers import TransformerBlock, build_norm, dropout_if_active
from .linear import Linear
from .recompute import lean_forward
from .moe import load_balancing_loss
from .mtp import MtpLayer, speculative_greedy
from .alibi import alibi_bias, alibi_slopes
from .masks import AttentionMask, packed_causal_mask, static_cache_mask, segment_ids_from_cu_seq_lens, segment_ids_from_position_ids, self_attention_mask
from .masks import with_position_bias
from .modeling_base import HfTinyPreTrainedModel
from .rope import RotaryEmbedding
from .transformers_api import cache_arguments, cache_of, check_cached_generation, with_cache
from .forward_utils import LayerOutputs, check_token_inputs, format_output, output_flags
from .validation import (
    check_attention_mask,
    check_cache_matches,
    check_labels,
    check_sequence_labels,
    is_compiling,
)

# Keyword arguments forward() takes besides its named ones. Anything else is an error: silently ignoring, say,
# packed-sequence boundaries (cu_seq_lens_*) would attend across sequences.
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
# skip_logits: loss without logits (chunked_loss.use_chunked_loss says when).
HEAD_KWARGS = ("skip_logits",)
# Sequence boundaries of a packed (padding-free) row, as DataCollatorWithFlattening(return_flash_attn_kwargs=True)
# passes them; without them the boundaries are read from restarting position_ids.
PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# transformers' continuous batching (generate_batch) runs the model on all requests' tokens flattened into one row,
# with a paged cache (passed as cache=, transformers_api.cache_arguments) that the attention modules fill through
# read_index= / write_index= / block_table= and the sequence boundaries in cu_seq_lens_* / max_length_* (per layer
# type); its masks arrive ready (4-D, per layer type). transformers before 5.2x names the longest sequences
# max_seqlen_q / max_seqlen_k there (later: max_length_q / _k).
PAGED_KWARGS = ("read_index", "write_index", "block_table", "is_causal", "logits_indices", "logits_processor_args",
                "max_seqlen_q", "max_seqlen_k")
# Read by continuous batching itself, never by the model (it slices the logits at logits_indices after forward).
PAGED_RUNNER_ONLY = ("logits_indices", "logits_processor_args", "is_causal")
# Older transformers versions pass cache_position from generate(); positions come from position_ids / the cache.
IGNORED_KWARGS = ("cache_position",)


def _check_extra_kwargs(owner: str, kwargs: dict, allowed: tuple) -> dict:
    unknown = sorted(k for k in kwargs if k not in allowed and k not in IGNORED_KWARGS)
    if unknown:
        raise TypeError(f"{owner}.forward() got unexpected keyword argument(s) {unknown}; accepted extras: {list(allowed)}")
    return {k: v for k, v in kwargs.items() if k in allowed}


class TinyCausalPreTrainedModel(HfTinyPreTrainedModel):
    config_class = TinyCausalConfig
    config: TinyCausalConfig
    base_model_prefix = "model"
    _no_split_modules = ["TransformerBlock"]
    _can_compile_fullgraph = True
    _supports_static_cache = True  # transformers 4.x name of the same promise

    def _decode(
        self, input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, output_attentions,
        output_hidden_states, **packing_kwargs,
    ) -> BaseModelOutputWithPast:
        """A head's run of its base model (self.model), always as a ModelOutput; packing_kwargs: the packed / paged
        extras, past_key_values (the cache's name before transformers 5.24), and output_router_logits for MoE
        models."""
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **packing_kwargs,
        )


class TinyCausalModel(TinyCausalPreTrainedModel):
    """Embeddings -> N pre-norm blocks -> final RMSNorm. Returns hidden states (and the cache)."""

    def __init__(self, config: TinyCausalConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        learned = config.position_embedding_type == "learned"
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size) if learned else None
        no_rope = config.position_embedding_type != "rope"
        self.embedding_dropout = nn.Dropout(config.embedding_dropout)
        self.layers = nn.ModuleList(
            TransformerBlock(config, config.block_spec(i), i) for i in range(config.num_hidden_layers)
        )
        self.norm = build_norm(
            config.norm_type, config.hidden_size, config.norm_eps(), unit_offset=config.rms_norm_unit_offset,
            bias=config.norm_bias,
        )
        # One rotary module per distinct rope_parameters: `rotary_emb` for full-attention layers (and every layer
        # when the parameters are not keyed by layer type), `sliding_rotary_emb` for sliding layers with their own.
        rotated = config.rotary_head_dim()
        self.rotary_emb = None if no_rope else RotaryEmbedding(
            config, config.rope_parameters_for("full_attention"), head_dim=rotated
        )
        sliding = config.rope_parameters_for("sliding_attention")
        own_sliding_rope = not no_rope and sliding != config.rope_parameters_for("full_attention")
        self.sliding_rotary_emb = RotaryEmbedding(config, sliding, head_dim=rotated) if own_sliding_rope else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        if self.config.scale_embeddings:  # Gemma: the scale rounded to the weights' dtype, as official
            embeds = embeds * torch.tensor(self.config.hidden_size**0.5, dtype=embeds.dtype, device=embeds.device)
        return embeds

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    # ------------------------------------------------------------------------------------------------------------
    # input checks
    # ------------------------------------------------------------------------------------------------------------

    def _check_positions(self, position_ids: torch.Tensor, batch_size: int, query_length: int) -> torch.Tensor:
        """position_ids: integers, [query_length] or [1 | batch, query_length], never negative. Rotary positions have
        no upper limit (as in official Llama: the rotation is computed for any position, and the scaled rope types
        exist to run past the trained length)."""
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

    def _check_learned_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Learned position embeddings exist for positions 0 .. max_position_embeddings - 1 only."""
        limit = self.config.max_position_embeddings
        if not is_compiling() and position_ids.numel() and int(position_ids.max()) >= limit:
            raise ValueError(
                f"position_ids reach {int(position_ids.max())} but this model learned max_position_embeddings={limit} "
                f"absolute positions (0 .. {limit - 1}); shorten the input (prompt + generated tokens <= {limit})"
            )
        return position_ids

    def _packed_segments(
        self, position_ids_given: bool, position_ids, attention_mask, cache, past_length, batch_size, kwargs
    ) -> Optional[torch.Tensor]:
        """Sequence index of each token when the row holds several packed sequences (no padding mask, no cached
        tokens): from cu_seq_lens_q/k when given, else from restarting position_ids. None otherwise."""
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        query_length = position_ids.shape[-1]
        if cu_q is not None or cu_k is not None:
            if past_length or attention_mask is not None:
                raise ValueError(
                    "cu_seq_lens_q/cu_seq_lens_k describe packed sequences of one forward without padding; they cannot "
                    f"be combined with cached tokens ({int(past_length)}) or an attention_mask"
                )
            cu = cu_q if cu_q is not None else cu_k
            if cu_q is not None and cu_k is not None and not torch.equal(cu_q.cpu(), cu_k.cpu()):
                raise ValueError(
                    f"cu_seq_lens_q={cu_q.tolist()} and cu_seq_lens_k={cu_k.tolist()} must be equal in self-attention "
                    "without a cache"
                )
            return segment_ids_from_cu_seq_lens(
                cu, batch_size=batch_size, length=query_length,
                field="cu_seq_lens_q" if cu_q is not None else "cu_seq_lens_k",
            )
        static = cache is not None and getattr(cache, "is_compileable", False)
        if not position_ids_given or attention_mask is not None or static or (not is_compiling() and int(past_length)):
            return None
        return segment_ids_from_position_ids(position_ids.expand(batch_size, -1))

    # ------------------------------------------------------------------------------------------------------------
    # masks
    # ------------------------------------------------------------------------------------------------------------

    def _masks_by_layer_type(self, attention_mask) -> Optional[dict]:
        """A dict attention_mask ({layer type: 4-D mask or None}, as generate() prepares for static caches of
        models with layer_types) checked to cover every layer type; None for any other attention_mask."""
        if not isinstance(attention_mask, dict):
            return None
        missing = sorted(set(self.config.layer_types) - set(attention_mask))
        for layer_type, mask in attention_mask.items():
            if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 4):
                missing.append(f"{layer_type} (not a 4-D tensor)")
        if missing:
            raise ValueError(
                f"attention_mask given per layer type (keys {sorted(attention_mask)}) needs a 4-D mask or None for "
                f"every layer type of this model {sorted(set(self.config.layer_types))}; wrong or missing: {missing}"
            )
        return attention_mask

    def _key_layout(self, cache: Optional[Cache], past_length, query_length: int, layer_idx: int):
        """(key_length, key_offset): the keys layer `layer_idx` attends to after its cache update are the absolute
        positions key_offset .. key_offset + key_length - 1 (a static cache also holds unfilled slots, a sliding
        layer's cache only the last window)."""
        if cache is None or not hasattr(cache, "get_mask_sizes"):
            return past_length + query_length, 0
        try:
            return cache.get_mask_sizes(query_length, layer_idx)
        except (TypeError, AttributeError):  # transformers versions whose signature takes cache positions
            positions = torch.arange(query_length, device=self.embed_tokens.weight.device) + past_length
            return cache.get_mask_sizes(positions, layer_idx)

    def _build_mask(
        self,
        attention_mask: Optional[torch.Tensor],
        cache: Optional[Cache],
        past_length,
        batch_size: int,
        query_length: int,
        device: torch.device,
        window: Optional[int],
        *,
        layer_idx: int,
    ) -> AttentionMask:
        """The mask of the layers of one type: `window` is their sliding window (None: full causal), `layer_idx`
        the first such layer (its cache tells which keys they hold)."""
        key_length, key_offset = self._key_layout(cache, past_length, query_length, layer_idx)
        if attention_mask is not None and attention_mask.dim() == 4:
            return self_attention_mask(
                attention_mask,
                batch_size=batch_size,
                query_length=query_length,
                key_length=key_length,
                causal=True,
                device=device,
            )
        static = cache is not None and getattr(cache, "is_compileable", False)
        if not static:
            # Dynamic caches return exactly the keys at positions key_offset .. past + new - 1: causality is
            # bottom-right aligned and the padding mask's last key_length columns belong to them.
            if attention_mask is not None:
                attention_mask = attention_mask[:, attention_mask.shape[-1] - key_length :]
            return self_attention_mask(
                attention_mask,
                batch_size=batch_size,
                query_length=query_length,
                key_length=key_length,
                causal=True,
                sliding_window=window,
                device=device,
            )
        return static_cache_mask(
            attention_mask, past_length, key_offset, key_length, batch_size, query_length, window, device
        )

    # ------------------------------------------------------------------------------------------------------------

    @lean_forward
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        output_router_logits: Optional[bool] = None,
        *,
        past_key_values: Optional[Cache] = None,
        **kwargs,
    ) -> Union[BaseModelOutputWithPast, MoeModelOutputWithPast, tuple]:
        """cache: the KV cache (past_key_values: its name before transformers 5.24), or continuous batching's paged
        cache. output_router_logits (MoE models; default config.output_router_logits): also return each sparse
        layer's router logits ([batch * seq, num_local_experts]) as `router_logits`."""
        _check_extra_kwargs(type(self).__name__, kwargs, PACKING_KWARGS + PAGED_KWARGS)
        cache, paged_cache = cache_arguments(cache, past_key_values)
        orphans = sorted(k for k in PAGED_KWARGS if k in kwargs and k not in PAGED_RUNNER_ONLY)
        if paged_cache is None and orphans:
            raise TypeError(
                f"{type(self).__name__}.forward() got {orphans} without cache=: these belong to transformers' "
                "continuous batching and describe its paged cache (pass that as cache=), or drop them"
            )
        if paged_cache is not None:
            return self._paged_forward(
                input_ids, attention_mask, position_ids, inputs_embeds, output_hidden_states, paged_cache, kwargs
            )
        config = self.config
        flags = output_flags(config, output_attentions, output_hidden_states, return_dict)
        use_cache = config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False  # the recomputation in backward would write the cache a second time

        check_token_inputs(config, input_ids, inputs_embeds)
        if input_ids is not None:
            inputs_embeds = self._embed(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=config)

        batch_size, query_length = inputs_embeds.shape[:2]
        device = inputs_embeds.device
        past_length = cache.get_seq_length() if cache is not None else 0
        if cache is not None and not is_compiling():
            cache_heads, cache_dim = config.cache_layout()
            check_cache_matches(
                cache, batch_size=batch_size, num_key_value_heads=cache_heads, head_dim=cache_dim,
            )
        masks_by_type = self._masks_by_layer_type(attention_mask)
        if masks_by_type is None and attention_mask is not None and not is_compiling() and (
            not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4
        ):
            check_attention_mask(attention_mask, expected_shape=(batch_size, int(past_length) + query_length))
        position_ids_given = position_ids is not None
        if position_ids is None:
            position_ids = (torch.arange(query_length, device=device) + past_length).unsqueeze(0)
        else:
            position_ids = self._check_positions(position_ids, batch_size, query_length)

        # Per layer type (full / sliding attention): its mask and its rotary cos/sin, each built once per forward.
        layer_types = dict.fromkeys(config.layer_types)
        if not interface_takes_mask(config._attn_implementation):
            # vLLM: one row of flattened sequences whose boundaries its attention function knows; no mask is used
            self._refuse_alibi(f"attn_implementation={config._attn_implementation!r}")
            masks = {layer_type: AttentionMask(None, True) for layer_type in layer_types}
        else:
            segment_ids = self._packed_segments(
                position_ids_given, position_ids, attention_mask, cache, past_length, batch_size, kwargs
            )
            masks = {}
            for layer_type in layer_types:
                window = config.sliding_window_for(layer_type)
                if segment_ids is not None:
                    masks[layer_type] = packed_causal_mask(segment_ids, sliding_window=window)
                else:
                    masks[layer_type] = self._build_mask(
                        attention_mask if masks_by_type is None else masks_by_type[layer_type], cache, past_length, batch_size, query_length, device, window,
                        layer_idx=config.layer_types.index(layer_type),
                    )
            if config.position_embedding_type == "alibi":
                masks = {
                    layer_type: self._with_alibi(mask, cache, past_length, query_length, layer_type, inputs_embeds.dtype)
                    for layer_type, mask in masks.items()
                }
        position_embeddings = self._position_embeddings(inputs_embeds, position_ids)
        router_logits = self._wants_router_logits(output_router_logits)
        output = self._run_layers(
            inputs_embeds, position_ids, masks, position_embeddings, cache, flags, router_logits=router_logits
        )
        return format_output(output, flags)

    def _with_alibi(self, mask: AttentionMask, cache, past_length, query_length: int, layer_type: str, dtype):
        """The layer type's mask with ALiBi's distance bias folded in (one float mask; queries are the positions
        past_length .., keys those the cache holds after the update, _key_layout)."""
        key_length, key_offset = self._key_layout(
            cache, past_length, query_length, self.config.layer_types.index(layer_type)
        )
        device = self.embed_tokens.weight.device
        queries = torch.arange(query_length, device=device) + past_length
        keys = torch.arange(key_length, device=device) + key_offset
        slopes = alibi_slopes(self.config.num_attention_heads, self.config.alibi_bias_max)
        return with_position_bias(mask, alibi_bias(slopes, queries, keys), dtype)

    def _refuse_alibi(self, where: str) -> None:
        if self.config.position_embedding_type == "alibi":
            raise ValueError(
                f"ALiBi adds a distance bias to the attention scores through the mask, which {where} does not take; "
                "use attn_implementation='sdpa' or 'eager'"
            )

    def _wants_router_logits(self, output_router_logits: Optional[bool]) -> bool:
        wanted = self.config.output_router_logits if output_router_logits is None else bool(output_router_logits)
        if wanted and not self.config.num_local_experts:
            raise ValueError(
                "output_router_logits=True needs a Mixture-of-Experts model; this one has num_local_experts=0"
            )
        return wanted

    def _run_layers(self, inputs_embeds, position_ids, masks, position_embeddings, cache, flags,
                    router_logits: bool = False, **attention_kwargs) -> BaseModelOutputWithPast:
        hidden_states = inputs_embeds
        if self.embed_positions is not None:
            hidden_states = hidden_states + self.embed_positions(self._check_learned_positions(position_ids))
        hidden_states = dropout_if_active(self.embedding_dropout, hidden_states)
        collected = LayerOutputs(flags)
        all_router_logits = () if router_logits else None
        with layer_workspace(hidden_states):
            for layer, layer_type in zip(self.layers, self.config.layer_types):
                mask = masks[layer_type]
                collected.add_hidden(hidden_states)
                hidden_states, attn_weights, _, layer_router_logits = layer(
                    hidden_states,
                    mask.mask,
                    position_embeddings[layer_type],
                    is_causal=mask.is_causal,
                    segment_ids=mask.segment_ids,
                    cache=cache,
                    output_attentions=flags.attentions,
                    **attention_kwargs,
                )
                collected.add_attentions(attn_weights)
                if all_router_logits is not None and layer_router_logits is not None:
                    all_router_logits += (layer_router_logits,)
        hidden_states = self.norm(hidden_states)
        collected.add_hidden(hidden_states)
        fields = dict(
            last_hidden_state=hidden_states,
            hidden_states=collected.hidden_states,
            attentions=collected.attentions,
        )
        if self.config.num_local_experts:
            return with_cache(MoeModelOutputWithPast, cache, **fields, router_logits=all_router_logits)
        return with_cache(BaseModelOutputWithPast, cache, **fields)

    def mtp_mask(self, attention_mask: Optional[torch.Tensor], position_ids: torch.Tensor, batch_size: int, length: int) -> AttentionMask:
        """The mask of a Multi-Token Prediction block over `length` positions without a cache: the 2-D padding
        mask's, packed rows' (restarting position_ids), or plain causal; full attention."""
        device = self.embed_tokens.weight.device
        if attention_mask is None and position_ids.shape[0] == batch_size:
            segment_ids = segment_ids_from_position_ids(position_ids)
            if bool((segment_ids != segment_ids[:, :1]).any()):
                return packed_causal_mask(segment_ids)
        return self._build_mask(attention_mask, None, 0, batch_size, length, device, None, layer_idx=0)

    def _rotary_for(self, layer_type: str):
        if layer_type == "sliding_attention" and self.sliding_rotary_emb is not None:
            return self.sliding_rotary_emb
        return self.rotary_emb

    def _position_embeddings(self, inputs_embeds, position_ids) -> dict:
        """{layer type: (cos, sin) broadcast over heads, or None for learned positions}."""
        embeddings = {}
        for layer_type in dict.fromkeys(self.config.layer_types):
            rotary = self._rotary_for(layer_type)
            if rotary is None:
                embeddings[layer_type] = None
            else:
                cos, sin = rotary(inputs_embeds, position_ids)
                embeddings[layer_type] = (cos.unsqueeze(1), sin.unsqueeze(1))
        return embeddings

    def _paged_forward(self, input_ids, attention_mask, position_ids, inputs_embeds, output_hidden_states, paged_cache,
                       kwargs):
        """One step of transformers' continuous batching: every request's new tokens in one row, `position_ids`
        restarting per request, the masks ready per layer type (None when the attention function reads the
        boundaries itself), and the paged cache passed through to the attention function, which stores K/V."""
        config = self.config
        self._refuse_alibi("continuous batching (a paged cache)")
        check_token_inputs(config, input_ids, inputs_embeds)
        if position_ids is None:
            raise ValueError("continuous batching (a paged `cache`) needs position_ids for the flattened requests")
        if input_ids is not None:
            inputs_embeds = self._embed(input_ids)
        is_causal = bool(kwargs.get("is_causal", False))
        masks = {}
        for layer_type in dict.fromkeys(config.layer_types):
            mask = attention_mask.get(layer_type) if isinstance(attention_mask, dict) else attention_mask
            masks[layer_type] = AttentionMask(mask, is_causal)
        attention_kwargs = {k: v for k, v in kwargs.items() if k not in PAGED_RUNNER_ONLY}
        flags = output_flags(config, False, output_hidden_states, True)
        return self._run_layers(
            inputs_embeds, position_ids, masks, self._position_embeddings(inputs_embeds, position_ids), paged_cache,
            flags, **attention_kwargs,
        )


_UNSET = object()  # an argument not given (None is a value: "no eos token")


@dataclass
class MtpCausalLMOutput(MoeCausalLMOutputWithPast):
    """The causal LM output of a model with Multi-Token Prediction modules: mtp_loss is L_MTP (already weighted by
    mtp_loss_weight and included in `loss`) when training with labels."""

    mtp_loss: Optional[torch.FloatTensor] = None


class TinyCausalForCausalLM(TinyCausalPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: TinyCausalConfig):
        super().__init__(config)
        self.model = TinyCausalModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = None
        if config.num_nextn_predict_layers:
            self.mtp = nn.ModuleList(
                MtpLayer(config, config.num_hidden_layers + k) for k in range(config.num_nextn_predict_layers)
            )
        self.post_init()

    def prepare_inputs_for_generation(self, input_ids, inputs_embeds=None, **kwargs):
        """longrope (Phi-3) as official: keys cached while the sequence was short were rotated with the short
        factors, so the step that first passes original_max_position_embeddings drops the cache and recomputes
        every key with the long ones. The cache arrives under the name the installed generate() uses (cache= from
        transformers 5.24 on, past_key_values= before) and is passed back under it."""
        rope = self.config.rope_parameters_for("full_attention")
        name = "cache" if "cache" in kwargs else "past_key_values"
        cache = kwargs.get(name)
        if rope["rope_type"] == "longrope" and cache is not None:
            switch = rope["original_max_position_embeddings"]
            if input_ids.shape[1] >= switch + 1 and cache.get_seq_length() <= switch:
                kwargs[name] = None
                kwargs["next_sequence_length"] = None
        return super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds, **kwargs)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def _logits_and_loss(self, hidden_states, labels, logits_to_keep, loss_kwargs):
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        softcap = self.config.final_logit_softcapping
        if softcap is not None:  # Gemma: c * tanh(logits / c)
            logits = torch.tanh(logits / softcap) * softcap
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs)
        return logits, loss

    def _chunked_loss(self, hidden_states, labels, *, ignore_index=-100, shift_labels=None, num_items_in_batch=None):
        """transformers' ForCausalLMLoss (labels shifted left, -100 appended) through the chunked head."""
        if shift_labels is None:
            shift_labels = labels_ahead(labels, 1, ignore_index)
        return linear_cross_entropy(
            hidden_states,
            self.lm_head.weight,
            shift_labels,
            bias=self.lm_head.bias,
            ignore_index=ignore_index,
            num_items_in_batch=num_items_in_batch,
            softcap=self.config.final_logit_softcapping,
        )

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        output_router_logits: Optional[bool] = None,
        *,
        past_key_values: Optional[Cache] = None,
        **kwargs,
    ) -> Union[CausalLMOutputWithPast, MoeCausalLMOutputWithPast, tuple]:
        """labels: token ids (-100 = ignored), unshifted; the loss predicts token t+1 from tokens <= t.
        num_items_in_batch (passed by Trainer): the loss is then summed and divided by it, so gradient
        accumulation over micro-batches equals one big batch. logits_to_keep: compute logits only for the last
        N positions (0 = all; generate passes 1), or for the given position indices.
        skip_logits: while training with labels the loss is computed a chunk of tokens at a time without the full
        logits (chunked_loss.py) and `logits` is None; skip_logits=False returns the logits as usual."""
        extras = _check_extra_kwargs(
            type(self).__name__, kwargs, LOSS_KWARGS + HEAD_KWARGS + PACKING_KWARGS + PAGED_KWARGS
        )
        loss_kwargs = {k: v for k, v in extras.items() if k in LOSS_KWARGS}
        chunked = use_chunked_loss(extras.pop("skip_logits", None), labels, training=self.training, head=self.lm_head)
        chunked = chunked and isinstance(logits_to_keep, int) and logits_to_keep == 0
        router_kwargs = {} if output_router_logits is None else {"output_router_logits": output_router_logits}
        outputs = self._decode(
            input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, output_attentions,
            output_hidden_states, **{k: v for k, v in extras.items() if k not in LOSS_KWARGS}, **router_kwargs,
            past_key_values=past_key_values,
        )
        hidden_states = outputs.last_hidden_state
        if labels is not None and "shift_labels" not in loss_kwargs:  # labels align with the input tokens (unshifted)
            check_labels(
                labels,
                num_classes=self.config.vocab_size,
                expected_shape=tuple(hidden_states.shape[:2]),
                ignore_index=loss_kwargs.get("ignore_index", -100),
            )
        if chunked:
            logits, loss = None, self._chunked_loss(hidden_states, labels, **loss_kwargs)
        else:
            logits, loss = self._logits_and_loss(hidden_states, labels, logits_to_keep, loss_kwargs)

        fields = dict(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        router_logits = getattr(outputs, "router_logits", None)
        mtp_loss = None
        if self.mtp is not None and labels is not None and self.training and self.config.mtp_loss_weight:
            mtp_loss = self._mtp_loss(hidden_states, input_ids, attention_mask, position_ids, labels, extras, loss_kwargs)
            loss = loss + mtp_loss
        aux_loss = self._aux_loss(router_logits, attention_mask)
        if aux_loss is not None and loss is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        fields["loss"] = loss
        cache = cache_of(outputs)
        if self.mtp is not None:
            output = with_cache(
                MtpCausalLMOutput, cache, **fields, aux_loss=aux_loss, mtp_loss=mtp_loss, router_logits=router_logits
            )
        elif self.config.num_local_experts:
            output = with_cache(MoeCausalLMOutputWithPast, cache, **fields, aux_loss=aux_loss, router_logits=router_logits)
        else:
            output = with_cache(CausalLMOutputWithPast, cache, **fields)
        return format_output(output, self.config.return_dict if return_dict is None else return_dict)

    def _mtp_loss(self, hidden_states, input_ids, attention_mask, position_ids, labels, extras, loss_kwargs):
        """L_MTP = mtp_loss_weight / D * sum_k L^k (mtp.py, eq. 21-25): depth k runs on positions 0 .. T-k-1 with the
        embeddings of tokens k .. T-1 and predicts tokens k+1 .. T (labels, unshifted, -100 ignored)."""
        if input_ids is None or any(key.startswith("cu_seq_lens") for key in extras):
            raise ValueError(
                "the Multi-Token Prediction loss needs input_ids (it embeds tokens t+1 .. t+D) and no cu_seq_lens_*; "
                "pass input_ids, or set mtp_loss_weight=0"
            )
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
            raise ValueError("the Multi-Token Prediction loss takes a 2-D padding attention_mask (or none)")
        batch, length = input_ids.shape
        depths = len(self.mtp)
        ignore_index = loss_kwargs.get("ignore_index", -100)
        total = hidden_states.new_zeros(())
        previous = hidden_states
        for depth, layer in enumerate(self.mtp, start=1):
            n = length - depth
            if n < 1:
                break
            positions = torch.arange(n, device=input_ids.device)[None] if position_ids is None else position_ids[..., :n]
            mask = self.model.mtp_mask(None if attention_mask is None else attention_mask[:, :n], positions, batch, n)
            rotary = self.model._position_embeddings(previous, positions)["full_attention"]
            previous = layer(previous[:, :n], self.model._embed(input_ids[:, depth:]), mask, rotary)
            total = total + self._chunked_loss(
                layer.norm(previous), None, ignore_index=ignore_index,
                shift_labels=labels_ahead(labels, depth + 1, ignore_index),
                num_items_in_batch=loss_kwargs.get("num_items_in_batch"),
            )
        return self.config.mtp_loss_weight / depths * total

    def generate(self, *args, use_mtp: bool = False, **kwargs):
        """generate(..., use_mtp=True): greedy decoding with the Multi-Token Prediction modules drafting (mtp.py's
        speculative_greedy), one sequence at a time (left-padded batches are split by attention_mask). Takes
        input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id; returns the ids like generate() and
        leaves the acceptance counts in self.mtp_stats. Anything else (sampling, beams) is an error."""
        check_cached_generation(self)
        if not use_mtp:
            return super().generate(*args, **kwargs)
        return self._generate_with_mtp(*args, **kwargs)

    def _generate_with_mtp(self, input_ids=None, attention_mask=None, *, max_new_tokens=None, eos_token_id=_UNSET,
                           pad_token_id=_UNSET, do_sample=False, num_beams=1, **unsupported):
        if self.mtp is None:
            raise ValueError("generate(use_mtp=True) needs Multi-Token Prediction modules; num_nextn_predict_layers=0")
        if unsupported or do_sample or num_beams != 1:
            raise ValueError(
                "generate(use_mtp=True) is greedy self-speculative decoding: do_sample=False and num_beams=1 only, and "
                f"input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id; got do_sample={do_sample}, "
                f"num_beams={num_beams}, other arguments {sorted(unsupported)}"
            )
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [batch, length] tensor, got {None if input_ids is None else tuple(input_ids.shape)}")
        generation = self.generation_config
        max_new_tokens = generation.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        # as generate(): an argument given (None included) replaces the generation config's value
        eos = generation.eos_token_id if eos_token_id is _UNSET else eos_token_id
        eos_ids = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
        pad = generation.pad_token_id if pad_token_id is _UNSET else pad_token_id
        if pad is None:
            pad = min(eos_ids, default=0)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        rows, self.mtp_stats = [], {"rounds": 0, "drafted": 0, "accepted": 0}
        for row, mask in zip(input_ids, attention_mask):
            real = int(mask.sum())
            if real == 0 or not bool(mask[mask.shape[0] - real :].all()):
                raise ValueError("generate(use_mtp=True) takes left-padded rows (each row's real tokens last, at least one)")
            new, stats = speculative_greedy(self, row[mask.shape[0] - real :][None], max_new_tokens, eos_ids)
            rows.append(new)
            for key in stats:
                self.mtp_stats[key] += stats[key]
        width = max(len(new) for new in rows)
        tail = torch.full((input_ids.shape[0], width), pad, dtype=input_ids.dtype, device=input_ids.device)
        for index, new in enumerate(rows):
            tail[index, : len(new)] = torch.tensor(new, dtype=input_ids.dtype)
        return torch.cat((input_ids, tail), dim=1)

    def _aux_loss(self, router_logits, attention_mask) -> Optional[torch.Tensor]:
        """The load-balancing loss of this forward's tokens; a 2-D padding mask's last columns are those tokens
        (earlier ones are cached), other masks (4-D, per layer type) weigh every token."""
        if not router_logits:
            return None
        tokens = router_logits[0].shape[0]
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            batch = attention_mask.shape[0]
            attention_mask = attention_mask[:, attention_mask.shape[1] - tokens // batch :]
        else:
            attention_mask = None
        return load_balancing_loss(
            router_logits, self.config.num_local_experts, self.config.num_experts_per_tok, attention_mask
        )


class TinyCausalForSequenceClassification(TinyCausalPreTrainedModel):
    """Scores the last non-padding token of each sequence (the rightmost token != pad_token_id, as Llama does)."""

    # The loss here is a per-batch mean: Trainer must divide it by the accumulation steps itself.
    accepts_loss_kwargs = False

    def __init__(self, config: TinyCausalConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = TinyCausalModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        *,
        past_key_values: Optional[Cache] = None,
        **kwargs,
    ) -> Union[SequenceClassifierOutputWithPast, tuple]:
        packing = _check_extra_kwargs(type(self).__name__, kwargs, PACKING_KWARGS)
        outputs = self._decode(
            input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, output_attentions,
            output_hidden_states, **packing, past_key_values=past_key_values,
        )
        logits = self.score(outputs.last_hidden_state)
        batch_size = logits.shape[0]
        pad_token_id = self.config.pad_token_id
        if pad_token_id is None and batch_size != 1:
            raise ValueError(
                "TinyCausalForSequenceClassification needs config.pad_token_id to find the last token of each "
                f"sequence in a batch of {batch_size}; set pad_token_id (e.g. to the tokenizer's pad token id)"
            )
        if pad_token_id is None or input_ids is None:
            last_token = torch.full((batch_size,), -1, device=logits.device, dtype=torch.long)
        else:
            not_pad = (input_ids != pad_token_id).to(logits.device, torch.int32)
            indices = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
            last_token = (indices * not_pad).argmax(-1)
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_token]

        loss = None
        if labels is not None:
            check_sequence_labels(
                labels, problem_type=self.config.problem_type, batch_size=batch_size, num_labels=self.num_labels
            )
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=pooled_logits, config=self.config)

        output = with_cache(
            SequenceClassifierOutputWithPast,
            cache_of(outputs),
            loss=loss,
            logits=pooled_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return format_output(output, self.config.return_dict if return_dict is None else return_dict)


__all__ = [
    "TinyCausalPreTrainedModel",
    "TinyCausalModel",
    "TinyCausalForCausalLM",
    "TinyCausalForSequenceClassification",
]

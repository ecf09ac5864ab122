"""The causal LM family (Llama and its relatives), read top-down:

    ids -> embed_tokens (x sqrt(hidden) for Gemma; + embed_positions for GPT-2)
        -> layers[0 .. N-1]   h = x + attn(norm(x));  out = h + mlp(norm(h))
        -> norm -> lm_head

The config chooses the parts the relatives differ in, never a copy of the model: norms (RMSNorm / LayerNorm,
Gemma's unit offset and sandwich norms), positions (RoPE per layer type, learned, ALiBi), attention (grouped
heads, q/k norms, sliding windows, DeepSeek's latent attention), feed-forward (gated, plain, Mixture-of-Experts)
and DeepSeek's Multi-Token Prediction modules. Parameter names are Llama's (model.embed_tokens,
model.layers.N.self_attn.q_proj, mlp.gate_proj, input_layernorm, post_attention_layernorm, model.norm, lm_head),
so PEFT target_modules, tensor-parallel plans and GGUF name maps work by habit.

What a forward's arguments mean (cache, positions, masks per layer type) is prepared once by step.py; generation
goes through transformers' GenerationMixin and Cache API.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    SequenceClassifierOutputWithPast,
)

from .chunked_loss import labels_ahead, linear_cross_entropy, use_chunked_loss
from .runtime import runtime_decoding, runtime_products, runtime_stack
from .configuration_causal import TinyCausalConfig
from .layers import (
    Attention, ClampedSwiGLUFeedForward, FeedForward, PreNormResidual, RotaryEmbedding, ScaledEmbedding, build_norm,
    feed_forward, query_temperature,
)
from .liger import register_liger_kernels
from .mla import LatentAttention
from .modeling_base import HfTinyPreTrainedModel, check_generation_kwargs
from .moe import SparseMoeFeedForward, TopKRouter, load_balancing_loss
from .mtp import MtpLayer, generate_with_mtp, mtp_loss
from .step import (
    LayerOutputs, check_extra_kwargs, check_skip_logits, format_output, masks_for_generate, output_flags,
    prepare_causal_step, cache_of, with_cache, PACKING_KWARGS,
)
from .transformers_api import check_cached_generation, deepseek_router_float32
from .validation import check_labels, check_sequence_labels, is_compiling, logger

# Keyword arguments the heads take besides the base model's: Trainer's loss normalisation and the chunked loss.
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
HEAD_KWARGS = ("skip_logits",)


# Keywords of generate() itself that it passes along with the model inputs.
GENERATE_ONLY_KWARGS = ("tokenizer", "assistant_tokenizer")


def norm_of(config: TinyCausalConfig) -> nn.Module:
    return build_norm(config.norm_type, config.hidden_size, config.norm_type_eps(),
                      unit_offset=config.rms_norm_unit_offset, bias=config.norm_bias,
                      float32_product=config.rounding.norm_product_float32)


def qk_norm_of(config: TinyCausalConfig, layer_idx: int) -> tuple[Optional[dict], str]:
    """(the RMSNorm arguments of the layer's q/k norm or None, where Attention applies it): qk_norm_type "head"
    and "projection" act before RoPE; Llama 4's "l2" has no weight and acts after RoPE, on rotary layers only."""
    kind = config.qk_norm_placement.qk_norm_type
    if not config.qk_norm or (kind == "l2" and not config.uses_rope(layer_idx)):
        return None, "head"
    if kind == "l2":
        return dict(eps=config.rms_norm_eps, elementwise_affine=False), "rotated"
    return dict(eps=config.rms_norm_eps, unit_offset=config.rms_norm_unit_offset,
                float32_product=config.rounding.norm_product_float32), kind


def attention_of(config: TinyCausalConfig, layer_idx: int) -> nn.Module:
    if config.mla_spec() is not None:
        return LatentAttention(config, layer_idx)
    qk_norm, qk_norm_at = qk_norm_of(config, layer_idx)
    output_bias = config.attention_bias if config.attention_output_bias is None else config.attention_output_bias
    return Attention(
        config, layer_idx, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, bias=config.attention_bias,
        output_bias=output_bias, scaling=config.attention_scale(), dropout=config.attention_dropout, is_causal=True,
        qk_norm=qk_norm, qk_norm_at=qk_norm_at, sinks=config.sinks.attention_sinks,
    )


def mlp_of(config: TinyCausalConfig, intermediate_size: int, *, gated: bool, bias: bool) -> nn.Module:
    """One feed-forward (a dense layer's or an expert): plain, gated, or GPT-OSS's clamped SwiGLU."""
    swiglu = config.clamped_swiglu
    if swiglu.swiglu_limit is not None:
        return ClampedSwiGLUFeedForward(config.hidden_size, intermediate_size, alpha=swiglu.swiglu_alpha,
                                        limit=swiglu.swiglu_limit, bias=bias)
    return feed_forward(config.hidden_size, intermediate_size, config.hidden_act, gated=gated, bias=bias)


def feed_forward_of(config: TinyCausalConfig, layer_idx: int) -> nn.Module:
    if config.is_sparse_layer(layer_idx):
        bias = config.moe_biases.expert_bias
        return SparseMoeFeedForward(config.hidden_size, config.moe_spec(),
                                    lambda size: mlp_of(config, size, gated=True, bias=bias))
    return mlp_of(config, config.intermediate_size, gated=config.mlp_gated, bias=config.mlp_bias)


class TinyCausalDecoderLayer(PreNormResidual, GradientCheckpointingLayer):
    """A pre-norm residual layer (layers.PreNormResidual): h = x + attn(norm(x)); out = h + mlp(norm(h)). Gemma 3 also
    norms each sublayer's output before the add (`sandwich_norms`), OLMo 2 norms only the outputs (`pre_norms=False`:
    h = x + norm(attn(x))); GPT-2 and Phi-3 drop the sublayer outputs at hidden_dropout while training."""

    def __init__(self, config: TinyCausalConfig, layer_idx: int):
        super().__init__()
        pre_norms, sandwich = config.norm_layout.pre_norms, config.sandwich_norms
        self.input_layernorm = norm_of(config) if pre_norms else None
        self.self_attn = attention_of(config, layer_idx)
        self.attn_output_layernorm = norm_of(config) if sandwich else None
        self.post_attention_layernorm = norm_of(config) if pre_norms else None
        self.mlp = feed_forward_of(config, layer_idx)
        self.mlp_output_layernorm = norm_of(config) if sandwich else None
        self.dropout = nn.Dropout(config.hidden_dropout) if config.hidden_dropout else None


class TinyCausalPreTrainedModel(HfTinyPreTrainedModel):
    config_class = TinyCausalConfig
    config: TinyCausalConfig
    base_model_prefix = "model"
    _no_split_modules = ["TinyCausalDecoderLayer"]
    _can_compile_fullgraph = True
    _supports_static_cache = True  # transformers 4.x name of the same promise

    def __init__(self, config: TinyCausalConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        spec = config.moe_spec()
        if spec is not None and spec.scoring == "sigmoid":
            # DeepSeek-V3's router stays float32 in a bf16 / fp16 model as the installed transformers keeps official's
            self._keep_in_fp32_modules_strict = deepseek_router_float32()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The shared init (modeling_base.py), and the MoE router's, a module only this family has."""
        super()._init_weights(module)
        if isinstance(module, TopKRouter):
            std = self.config.initializer_range
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.normal_(module.bias, mean=0.0, std=std)  # as official GPT-OSS's router
            if module.e_score_correction_bias is not None:
                init.zeros_(module.e_score_correction_bias)

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """transformers' pass over the modules (_init_weights), then GPT-2's residual projections: with the family's
        learned positions (GPT-2), each residual branch's output projection (official's c_proj; o_proj, down_proj)
        is drawn with std / sqrt(2 * layers), the GPT-2 paper's scheme, as official GPT2PreTrainedModel does. Here
        and not in _init_weights: transformers skips a custom model's module without parameters of its own (the
        attention, the feed-forward), so a module never sees which Linear it holds as its output. Loaded tensors
        are left as they are (transformers.initialization skips them)."""
        super().initialize_weights()
        if self.config.position_embedding_type != "learned":
            return
        std = self.config.initializer_range / math.sqrt(2 * self.config.num_hidden_layers)
        for module in self.modules():
            if isinstance(module, (Attention, FeedForward)):
                init.normal_((module.o_proj if isinstance(module, Attention) else module.down_proj).weight, 0.0, std)


class TinyCausalModel(TinyCausalPreTrainedModel):
    """Embeddings -> N decoder layers -> final norm. Returns hidden states (and the cache)."""

    def __init__(self, config: TinyCausalConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id if config.padding_row.use_padding_idx else None
        self.vocab_size = config.vocab_size
        if config.scale_embeddings:  # Gemma
            self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size, self.padding_idx,
                                                config.hidden_size**0.5)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        learned = config.position_embedding_type == "learned"
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size) if learned else None
        self.embedding_dropout = nn.Dropout(config.embedding_dropout) if config.embedding_dropout else None
        self.layers = nn.ModuleList(TinyCausalDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm_of(config)
        # One rotary module per distinct rope_parameters: `rotary_emb` for full-attention layers (and every layer when
        # the parameters are not keyed by layer type), `sliding_rotary_emb` for sliding layers with their own.
        rope = config.position_embedding_type == "rope"
        full, sliding = config.rope_parameters_for("full_attention"), config.rope_parameters_for("sliding_attention")
        float32 = config.rounding.rope_float32
        self.rotary_emb = (RotaryEmbedding(config, full, head_dim=config.rotary_head_dim(), float32=float32)
                           if rope else None)
        own_sliding = rope and sliding != full
        self.sliding_rotary_emb = (RotaryEmbedding(config, sliding, head_dim=config.rotary_head_dim(), float32=float32)
                                   if own_sliding else None)
        self.nope_layers = frozenset(config.nope.nope_layers)
        self.is_moe = config.moe_spec() is not None
        self.cache_layout = config.cache_layout()  # (heads, key dimension) of what the KV cache holds per token
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def rotary_positions(self, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                         layer_type: str = "full_attention") -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The layer type's rotary (cos, sin); None without rotary positions."""
        rotary = self.sliding_rotary_emb if layer_type == "sliding_attention" and self.sliding_rotary_emb else self.rotary_emb
        return None if rotary is None else rotary(hidden_states, position_ids)

    def layer_positions(self, hidden_states: torch.Tensor, step) -> list:
        """What each layer's attention takes as positions: its layer type's rotary (cos, sin); on NoPE layers
        nothing, or Llama 4's query temperature of each token's cache index."""
        rotary = {kind: self.rotary_positions(hidden_states, step.position_ids, kind)
                  for kind in dict.fromkeys(self.config.layer_types)}
        nope = None
        temperature = self.config.attn_temperature if self.nope_layers else None
        if temperature is not None and temperature.attn_temperature_tuning:
            nope = query_temperature(step.token_indices(), temperature.floor_scale, temperature.attn_scale)
        return [nope if index in self.nope_layers else rotary[layer_type]
                for index, layer_type in enumerate(self.config.layer_types)]

    @runtime_stack
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, output_attentions=None, output_hidden_states=None, return_dict=None,
                output_router_logits=None, *, past_key_values=None, token_type_ids=None, **kwargs):
        """cache: the KV cache (past_key_values: its name before transformers 5.24), or continuous batching's paged
        cache. output_router_logits (MoE models; default config.output_router_logits): also return each sparse
        layer's router logits ([batch * seq, num_local_experts]). token_type_ids: GPT-2's (with learned positions),
        rows of the word embeddings added to the inputs; other models ignore them, as official Llama-family models
        do (with a warning)."""
        flags = output_flags(self.config, output_attentions, output_hidden_states, return_dict)
        step = prepare_causal_step(self, input_ids, inputs_embeds, attention_mask, position_ids, cache,
                                   past_key_values, use_cache, flags, kwargs)
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embed_positions is not None:
            hidden_states = hidden_states + self.embed_positions(self._learned_positions(step.position_ids))
        if token_type_ids is not None and self.embed_positions is not None:
            hidden_states = hidden_states + self._token_type_embeddings(token_type_ids, hidden_states.shape[:2])
        elif token_type_ids is not None:
            logger.warning_once("token_type_ids are ignored: only GPT-2-style models (learned positions) read them, "
                                f"and this one has position_embedding_type={self.config.position_embedding_type!r}")
        if self.embedding_dropout is not None:
            hidden_states = self.embedding_dropout(hidden_states)
        positions = self.layer_positions(hidden_states, step)
        with self._collected_outputs(step.flags, output_router_logits) as collected:
            # generate's assistant_early_exit drafts with the first config.num_hidden_layers layers, set for the draft
            # (the plain list is cut: slicing the ModuleList would build a new module at every step)
            layer_types = self.config.layer_types[: self.config.num_hidden_layers]
            for layer, layer_type, layer_positions in zip(self.layers, layer_types, positions):
                if step.flags.hidden_states:
                    collected.add_hidden(hidden_states)
                hidden_states = layer(hidden_states, step.masks[layer_type], layer_positions, cache=step.cache,
                                      output_attentions=step.flags.attentions, **step.attention_kwargs)
            hidden_states = self.norm(hidden_states)
            collected.add_hidden(hidden_states)
        fields = dict(last_hidden_state=hidden_states, hidden_states=collected.hidden_states, attentions=collected.attentions)
        if self.is_moe:
            fields["router_logits"] = collected.router_logits
        output_class = MoeModelOutputWithPast if self.is_moe else BaseModelOutputWithPast
        return format_output(with_cache(output_class, step.returned_cache, **fields), step.flags.return_dict)

    def _token_type_embeddings(self, token_type_ids: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """GPT-2's token types: the word embeddings' rows of their ids ([batch, seq], or one row for every sequence),
        added to the inputs beside the learned positions, as official GPT-2 adds them."""
        if token_type_ids.shape[-1] != shape[1] or token_type_ids.numel() not in (shape[1], shape[0] * shape[1]):
            raise ValueError(f"token_type_ids of shape {tuple(token_type_ids.shape)} do not match the input's "
                             f"[batch, seq] = {list(shape)}")
        return self.embed_tokens(token_type_ids.reshape(-1, shape[1]))

    def _learned_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Learned position embeddings exist for positions 0 .. max_position_embeddings - 1 only."""
        limit = self.config.max_position_embeddings
        if not is_compiling() and position_ids.numel() and int(position_ids.max()) >= limit:
            raise ValueError(
                f"position_ids reach {int(position_ids.max())} but this model learned max_position_embeddings={limit} "
                f"absolute positions (0 .. {limit - 1}); shorten the input (prompt + generated tokens <= {limit})"
            )
        return position_ids

    def _collected_outputs(self, flags, output_router_logits: Optional[bool]) -> LayerOutputs:
        if not self.is_moe and output_router_logits:
            raise ValueError(
                "output_router_logits=True needs a Mixture-of-Experts model; this one is dense (num_local_experts=0)"
            )
        wanted = self.is_moe and (self.config.moe.output_router_logits if output_router_logits is None else output_router_logits)
        routers = [layer.mlp.gate for layer in self.layers if isinstance(layer.mlp, SparseMoeFeedForward)] if wanted else ()
        attention = [layer.self_attn for layer in self.layers] if flags.attentions else ()
        return LayerOutputs(flags, attention_modules=attention, routers=routers)


@dataclass
class MtpCausalLMOutput(MoeCausalLMOutputWithPast):
    """The causal LM output of a model with Multi-Token Prediction modules: mtp_loss is L_MTP (already weighted by
    mtp_loss_weight and included in `loss`) when training with labels."""

    mtp_loss: Optional[torch.FloatTensor] = None


def longrope_switch(config: TinyCausalConfig) -> Optional[int]:
    """longrope (Phi-3): the length past which generation recomputes its cache (prepare_inputs_for_generation), read
    once from the config, as the rotary module reads its parameters; None for every other rope type, and where the
    config keeps the cache there (longrope_cache_kept: official Llama, Qwen2, Gemma 3)."""
    rope = config.rope_parameters_for("full_attention")
    if rope["rope_type"] != "longrope" or config.longrope_cache.longrope_cache_kept:
        return None
    return rope["original_max_position_embeddings"]


class TinyCausalForCausalLM(TinyCausalPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: TinyCausalConfig):
        super().__init__(config)
        self.model = TinyCausalModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        depth = config.mtp_depth()
        blocks = (TinyCausalDecoderLayer(config, config.num_hidden_layers + k) for k in range(depth))
        self.mtp = nn.ModuleList(MtpLayer(config, block) for block in blocks) if depth else None
        self._longrope_switch = longrope_switch(config)
        self.post_init()

    def __setstate__(self, state: dict) -> None:
        """Unpickling (torch.save of the whole model, copy.deepcopy): a model pickled before the longrope switch was
        kept on the instance gets it from its config."""
        super().__setstate__(state)
        if "_longrope_switch" not in self.__dict__:
            self._longrope_switch = longrope_switch(self.config)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def prepare_inputs_for_generation(self, input_ids, inputs_embeds=None, **kwargs):
        """longrope (Phi-3) as official: keys cached while the sequence was short were rotated with the short
        factors, so the step that first passes original_max_position_embeddings drops the cache and recomputes
        every key with the long ones. The cache arrives under the name the installed generate() uses (cache= from
        transformers 5.24 on, past_key_values= before) and is passed back under it. generate() hands its own
        tokenizer= (stop_strings, token healing) on with the model inputs; official forwards swallow it in **kwargs,
        ours refuses unknown keywords, so it stops here."""
        for name in GENERATE_ONLY_KWARGS:
            kwargs.pop(name, None)
        switch = self._longrope_switch
        if switch is not None:
            name = "cache" if "cache" in kwargs else "past_key_values"
            cache = kwargs.get(name)
            if cache is not None and input_ids.shape[1] >= switch + 1 and cache.get_seq_length() <= switch:
                kwargs[name] = None
                kwargs["next_sequence_length"] = None
        return super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds, **kwargs)

    def create_masks_for_generate(self, **kwargs):
        """generate()'s masks for a static cache (transformers calls this method where a model has it): for eager
        and sdpa the 2-D padding mask, padded to the cache's length as transformers pads it, the masks built inside
        the (compiled) step; see step.masks_for_generate."""
        return masks_for_generate(**kwargs)

    @runtime_decoding(head="lm_head")
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, output_attentions=None, output_hidden_states=None, return_dict=None,
                logits_to_keep=0, output_router_logits=None, *, past_key_values=None, token_type_ids=None, **kwargs):
        """labels: token ids (-100 = ignored), unshifted: the loss predicts token t+1 from tokens <= t (keyword
        arguments of the loss: LOSS_KWARGS, HEAD_KWARGS; see _losses). logits_to_keep: logits of the last N
        positions only (0: all; generate passes 1), or of the given position indices. token_type_ids: GPT-2's
        (TinyCausalModel.forward)."""
        head_kwargs = {k: kwargs.pop(k) for k in LOSS_KWARGS + HEAD_KWARGS if k in kwargs}
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if not return_dict:  # a tuple is read by position: the logits keep theirs (no chunked loss without them)
            head_kwargs.setdefault("skip_logits", False)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, return_dict=True, output_router_logits=output_router_logits,
            past_key_values=past_key_values, token_type_ids=token_type_ids, **kwargs,
        )
        check_skip_logits(head_kwargs.get("skip_logits"), labels)
        if labels is None:
            logits, losses = self._logits(outputs.last_hidden_state, logits_to_keep), {"loss": None}
        else:
            logits, losses = self._losses(outputs.last_hidden_state, labels, logits_to_keep, head_kwargs,
                                          (input_ids, attention_mask, position_ids, kwargs))
        fields = dict(logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions, **losses)
        output_class = CausalLMOutputWithPast
        if self.model.is_moe or self.mtp is not None:
            output_class = MtpCausalLMOutput if self.mtp is not None else MoeCausalLMOutputWithPast
            fields.update(self._routing(getattr(outputs, "router_logits", None), attention_mask, fields["loss"]))
        return format_output(with_cache(output_class, cache_of(outputs), **fields), return_dict)

    @runtime_products
    def _logits(self, hidden_states: torch.Tensor, logits_to_keep) -> torch.Tensor:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        softcap = self.config.final_logit_softcapping
        return logits if softcap is None else torch.tanh(logits / softcap) * softcap  # Gemma: c * tanh(logits / c)

    def _losses(self, hidden_states, labels, logits_to_keep, head_kwargs: dict, inputs: tuple):
        """(logits, {loss, and mtp_loss for MTP models}). num_items_in_batch (passed by Trainer): the loss is summed
        and divided by it, so gradient accumulation over micro-batches equals one big batch. skip_logits: while
        training the loss is computed a chunk of tokens at a time without the full logits (chunked_loss.py) and
        the logits are None; skip_logits=False returns them as usual."""
        loss_kwargs = {k: v for k, v in head_kwargs.items() if k in LOSS_KWARGS}
        if "shift_labels" not in loss_kwargs:  # labels align with the input tokens (unshifted)
            check_labels(labels, num_classes=self.config.vocab_size, expected_shape=tuple(hidden_states.shape[:2]),
                         ignore_index=loss_kwargs.get("ignore_index", -100))
        chunked = use_chunked_loss(head_kwargs.get("skip_logits"), labels, model=self, head=self.lm_head)
        # under torch.compile / torch.export the plain loss: the chunked one's backward branches on the data
        chunked = chunked and not torch.compiler.is_compiling()
        if chunked and isinstance(logits_to_keep, int) and logits_to_keep == 0:
            logits, loss = None, self._chunked_loss(hidden_states, labels, **loss_kwargs)
        else:
            logits = self._logits(hidden_states, logits_to_keep)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs)
        if self.mtp is None:
            return logits, {"loss": loss}
        mtp_loss = self._mtp_loss(hidden_states, *inputs[:3], labels, inputs[3], loss_kwargs)
        return logits, {"loss": loss if mtp_loss is None else loss + mtp_loss, "mtp_loss": mtp_loss}

    def _routing(self, router_logits, attention_mask, loss) -> dict:
        """The router logits, their load-balancing loss (Switch Transformer's, as transformers computes it for
        Mixtral), and the loss with router_aux_loss_coef times it added."""
        aux_loss = self._aux_loss(router_logits, attention_mask) if router_logits else None
        if aux_loss is not None and loss is not None:
            loss = loss + self.config.moe.router_aux_loss_coef * aux_loss.to(loss.device)
        return {"router_logits": router_logits, "aux_loss": aux_loss, "loss": loss}

    def _chunked_loss(self, hidden_states, labels, *, ignore_index=-100, shift_labels=None, num_items_in_batch=None):
        """transformers' ForCausalLMLoss (labels shifted left, -100 appended) through the chunked head."""
        if shift_labels is None:
            shift_labels = labels_ahead(labels, 1, ignore_index)
        return linear_cross_entropy(
            hidden_states, self.lm_head.weight, shift_labels, bias=self.lm_head.bias, ignore_index=ignore_index,
            num_items_in_batch=num_items_in_batch, softcap=self.config.final_logit_softcapping,
        )

    def _head_loss(self, hidden_states, shift_labels, *, ignore_index=-100, num_items_in_batch=None):
        """The LM loss of hidden states against aligned labels, through the head as the main loss takes it: chunked
        where the head is a plain nn.Linear (and the runtime's path is on), else through its logits, so that a PEFT
        adapter or a hook on lm_head takes part (MTP's depths)."""
        if use_chunked_loss(None, shift_labels, model=self, head=self.lm_head) and not torch.compiler.is_compiling():
            return self._chunked_loss(hidden_states, None, ignore_index=ignore_index, shift_labels=shift_labels,
                                      num_items_in_batch=num_items_in_batch)
        return self.loss_function(logits=self._logits(hidden_states, 0), labels=None, vocab_size=self.config.vocab_size,
                                  shift_labels=shift_labels, ignore_index=ignore_index,
                                  num_items_in_batch=num_items_in_batch)

    def _mtp_loss(self, hidden_states, input_ids, attention_mask, position_ids, labels, kwargs, loss_kwargs):
        """L_MTP = mtp_loss_weight / D * sum_k L^k (mtp.py, eq. 21-25) while training; else None."""
        if not self.training or not self.config.mtp.mtp_loss_weight:
            return None
        return mtp_loss(self, hidden_states, input_ids, attention_mask, position_ids, labels, kwargs, loss_kwargs)

    def _aux_loss(self, router_logits, attention_mask) -> torch.Tensor:
        """The load-balancing loss of this forward's tokens; a 2-D padding mask's last columns are those tokens
        (earlier ones are cached), other masks (4-D, per layer type) weigh every token."""
        tokens = router_logits[0].shape[0]
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            attention_mask = attention_mask[:, attention_mask.shape[1] - tokens // attention_mask.shape[0] :]
        else:
            attention_mask = None
        spec = self.config.moe_spec()
        return load_balancing_loss(router_logits, spec.num_experts, spec.top_k, attention_mask)

    def generate(self, *args, use_mtp: bool = False, **kwargs):
        """generate(..., use_mtp=True): greedy decoding with the Multi-Token Prediction modules drafting (mtp.py's
        generate_with_mtp), one sequence at a time; anything else is GenerationMixin.generate."""
        check_cached_generation(self)
        check_generation_kwargs(kwargs)
        if "token_type_ids" in kwargs and self.model.embed_positions is None:  # as official Llama's generate
            raise ValueError("generate() got token_type_ids, which only GPT-2-style models (learned positions) read; "
                             f"this one has position_embedding_type={self.config.position_embedding_type!r}")
        if not use_mtp:
            return super().generate(*args, **kwargs)
        return generate_with_mtp(self, *args, **kwargs)

    def _get_static_cache_init_shape(self):
        """(heads, head dimension) with which generate fills a static cache before the first forward (with
        prefill_chunk_size), or None to leave the cache to its first write: MLA's cache holds a latent (keys
        kv_lora_rank wide, values qk_rope_head_dim wide), which no (heads, head dimension) describes; official
        leaves MLA models' caches to their first write too."""
        if self.config.mla.in_use(self.config):
            return None
        return super()._get_static_cache_init_shape()


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
        cache=None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        *,
        past_key_values=None,
        token_type_ids: Optional[torch.LongTensor] = None,
        **kwargs,
    ) -> Union[SequenceClassifierOutputWithPast, tuple]:
        packing = check_extra_kwargs(type(self).__name__, kwargs, PACKING_KWARGS)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, return_dict=True, past_key_values=past_key_values,
            token_type_ids=token_type_ids, **packing,
        )
        logits = self.score(outputs.last_hidden_state)
        pooled_logits = logits[torch.arange(logits.shape[0], device=logits.device), self._last_tokens(input_ids, logits)]
        loss = None
        if labels is not None:
            check_sequence_labels(labels, problem_type=self.config.problem_type, batch_size=logits.shape[0],
                                  num_labels=self.num_labels)
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=pooled_logits, config=self.config)
        output = with_cache(SequenceClassifierOutputWithPast, cache_of(outputs), loss=loss, logits=pooled_logits,
                            hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return format_output(output, self.config.return_dict if return_dict is None else return_dict)

    def _last_tokens(self, input_ids, logits) -> torch.Tensor:
        batch_size, pad_token_id = logits.shape[0], self.config.pad_token_id
        if pad_token_id is None and batch_size != 1:
            raise ValueError(
                "TinyCausalForSequenceClassification needs config.pad_token_id to find the last token of each "
                f"sequence in a batch of {batch_size}; set pad_token_id (e.g. to the tokenizer's pad token id)"
            )
        if pad_token_id is not None and input_ids is None:
            logger.warning_once(
                f"{type(self).__name__} will not detect padding tokens in `inputs_embeds`. Results may be unexpected "
                "if using padding tokens in conjunction with `inputs_embeds.`"  # official's words
            )
        if pad_token_id is None or input_ids is None:
            return torch.full((batch_size,), -1, device=logits.device, dtype=torch.long)
        not_pad = (input_ids != pad_token_id).to(logits.device, torch.int32)
        indices = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
        return (indices * not_pad).argmax(-1)


register_liger_kernels()  # TrainingArguments(use_liger_kernel=True) finds this family in Liger-Kernel's table


def _register_with_trainers_causal_lms() -> None:
    """Trainer's label smoother (label_smoothing_factor) shifts the labels only for a model whose class name is among
    transformers' causal LMs (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), where AutoModelForCausalLM.register does not add a
    custom class: each position was smoothed against its own token. Here, with the code a saved folder carries, so
    trust_remote_code loads register too. The Auto mappings read only model types that have a config class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(TinyCausalConfig.model_type, TinyCausalForCausalLM.__name__)


_register_with_trainers_causal_lms()

__all__ = [
    "TinyCausalPreTrainedModel",
    "TinyCausalModel",
    "TinyCausalForCausalLM",
    "TinyCausalForSequenceClassification",
]

"""The encoder-decoder (seq2seq) family: BART-, T5- and BERT-warm-start-style models from one set of blocks.

ids -> embeddings (tokens [* sqrt(d)] [+ token type 0] [+ learned / sinusoidal positions] [-> norm] -> dropout)
    -> N TinySeq2SeqLayers (the decoder's add cross-attention over the encoder states) [-> final norm]
    -> decoder only: [* d ** -0.5] [-> BERT transform] -> LM head [+ bias].
T5's relative position bias is computed once per stack (its table lives on the stack, like T5's first layer)
and folded into the self-attention mask of every layer.

This file holds the model classes, the ones config.json's auto_map names (TinySeq2SeqModel,
TinySeq2SeqForConditionalGeneration); the encoder and decoder stacks they hold are in seq2seq_stack.py.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput
from transformers.utils import ModelOutput

from .chunked_loss import linear_cross_entropy, use_chunked_loss
from .configuration_seq2seq import TinySeq2SeqConfig
from .modeling_base import HfTinyPreTrainedModel, check_generation_kwargs
from .runtime import runtime_decoding, runtime_products
from .seq2seq_stack import SinusoidalPositions, TinySeq2SeqLayer, TinySeq2SeqStack  # noqa: F401 (re-exported)
from .step import cache_of, format_output, output_flags, with_cache
from .transformers_api import check_cached_generation
from .validation import check_labels


def shift_tokens_right(labels: torch.Tensor, pad_token_id: Optional[int], decoder_start_token_id: Optional[int],
                       source: str = "labels"):
    """Decoder inputs for teacher forcing: [start, y0, y1, ...], with ignored labels (-100) replaced by pad. source:
    what is shifted, for the errors ("labels", or BART's "input_ids")."""
    if decoder_start_token_id is None:
        raise ValueError(
            "decoder_start_token_id is None: set config.decoder_start_token_id (the first decoder input) to build "
            f"decoder_input_ids from {source}, or pass decoder_input_ids"
        )
    if pad_token_id is None:
        raise ValueError(f"pad_token_id is None: set config.pad_token_id to build decoder_input_ids from {source} "
                         "(it replaces ignored positions, -100), or pass decoder_input_ids")
    shifted = labels.new_zeros(labels.shape)
    shifted[:, 1:] = labels[:, :-1].clone()
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


class LMHeadTransform(nn.Module):
    """BERT's prediction-head transform: dense -> activation -> LayerNorm."""

    def __init__(self, config: TinySeq2SeqConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act_fn = ACT2FN[config.hidden_act]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act_fn(self.dense(hidden_states)))


def _outputs_require_grad(module, inputs, output):
    output.requires_grad_(True)


class TinySeq2SeqPreTrainedModel(HfTinyPreTrainedModel):
    _has_lm_head = False  # True for the LM class: its tied head enters the tie map
    config_class = TinySeq2SeqConfig
    config: TinySeq2SeqConfig
    _no_split_modules = ["TinySeq2SeqLayer"]
    # All embeddings that may be tied; get_expanded_tied_weights_keys picks the ones this config ties.
    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }

    def __init__(self, config: TinySeq2SeqConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        if config.t5_half_precision:  # official T5PreTrainedModel's ["wo"]; read by post_init (TinySeq2SeqConfig)
            self._keep_in_fp32_modules = ["down_proj"]

    def _tie_map(self, prefix: str) -> dict[str, str]:
        shared = f"{prefix}shared.weight"
        mapping = {f"{prefix}encoder.embed_tokens.weight": shared}
        decoder_embedding = f"{prefix}decoder.embed_tokens.weight"
        if self.config.share_encoder_decoder_embeddings:
            mapping[decoder_embedding] = shared
            decoder_embedding = shared
        if self._has_lm_head and self.config.tie_word_embeddings:
            mapping["lm_head.weight"] = decoder_embedding
        return mapping

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # transformers ties nothing unless tie_word_embeddings is set; the encoder (and, when shared, the decoder)
        # input embeddings are always the `shared` table, whatever the head does.
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        return self._tie_map("model." if self._has_lm_head else "")

    def enable_input_require_grads(self):
        """transformers hooks the input embeddings of each PreTrainedModel inside (official BART's encoder and decoder
        are ones); our stacks are plain modules whose forward calls their own `embed_tokens` (holding `shared`'s
        weight), so those are hooked too: else reentrant checkpointing (QLoRA's default) sees no input needing grad."""
        super().enable_input_require_grads()
        hooked = {id(self.get_input_embeddings())}
        for stack in (self.get_encoder(), self.get_decoder()):
            if id(stack.embed_tokens) not in hooked:
                hooked.add(id(stack.embed_tokens))
                self._require_grads_hooks.append(stack.embed_tokens.register_forward_hook(_outputs_require_grad))

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, TinySeq2SeqForConditionalGeneration) and module.final_logits_bias is not None:
            init.zeros_(module.final_logits_bias)


def _check_encoder_outputs(encoder_states: torch.Tensor, config: TinySeq2SeqConfig, attention_mask, batch: Optional[int]):
    if not isinstance(encoder_states, torch.Tensor):
        raise TypeError(
            f"encoder_outputs[0] must be a tensor [batch, encoder_length, {config.hidden_size}], "
            f"got {type(encoder_states).__name__}"
        )
    if encoder_states.dim() != 3 or encoder_states.shape[-1] != config.hidden_size:
        raise ValueError(
            f"encoder_outputs[0] must have shape [batch, encoder_length, hidden_size={config.hidden_size}], "
            f"got {tuple(encoder_states.shape)}"
        )
    if batch is not None and encoder_states.shape[0] != batch:
        raise ValueError(
            f"encoder_outputs[0] has batch size {encoder_states.shape[0]} but the decoder input has batch size {batch}"
        )
    if attention_mask is not None and attention_mask.dim() == 2 and tuple(attention_mask.shape) != tuple(encoder_states.shape[:2]):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but encoder_outputs[0] covers "
            f"{tuple(encoder_states.shape[:2])} (batch, encoder_length)"
        )


class TinySeq2SeqModel(TinySeq2SeqPreTrainedModel):
    def __init__(self, config: TinySeq2SeqConfig):
        super().__init__(config)
        padding_idx = config.pad_token_id if config.use_padding_idx else None
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=padding_idx)
        self.encoder = TinySeq2SeqStack(config, is_decoder=False)
        self.decoder = TinySeq2SeqStack(config, is_decoder=True)
        self.post_init()

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, value):
        self.shared = value
        self.encoder.embed_tokens = value
        if self.config.share_encoder_decoder_embeddings:
            self.decoder.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, cache: Optional[Cache] = None, inputs_embeds=None, decoder_inputs_embeds=None,
                use_cache=None, output_attentions=None, output_hidden_states=None, return_dict=None, *,
                past_key_values: Optional[Cache] = None):
        """cache: an EncoderDecoderCache (past_key_values: its name before transformers 5.24)."""
        flags = output_flags(self.config, output_attentions, output_hidden_states, return_dict)
        if use_cache is None:  # a training forward that records gradients builds none (docs/compatibility.md)
            use_cache = self.config.use_cache and not (self.training and torch.is_grad_enabled())
        if decoder_input_ids is None and decoder_inputs_embeds is None and self.config.decoder_inputs_from_input_ids:
            if input_ids is None:
                raise ValueError("without decoder_input_ids or decoder_inputs_embeds the decoder's input is input_ids "
                                 "shifted right (decoder_inputs_from_input_ids), so input_ids cannot be None")
            decoder_input_ids = shift_tokens_right(input_ids, self.config.pad_token_id,
                                                   self.config.decoder_start_token_id, source="input_ids")
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError(
                "the decoder needs an input: pass decoder_input_ids (starting with decoder_start_token_id="
                f"{self.config.decoder_start_token_id}) or labels (shifted right into decoder_input_ids); a BART "
                "folder converted before its converter set decoder_inputs_from_input_ids shifts input_ids when loaded "
                "with decoder_inputs_from_input_ids=True"
            )
        encoder_outputs = self._encoded(encoder_outputs, input_ids, attention_mask, inputs_embeds, flags)
        decoder_batch = (decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds).shape[0]
        _check_encoder_outputs(encoder_outputs.last_hidden_state, self.config, attention_mask, decoder_batch)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids, attention_mask=decoder_attention_mask, inputs_embeds=decoder_inputs_embeds,
            encoder_hidden_states=encoder_outputs.last_hidden_state, encoder_attention_mask=attention_mask,
            cache=cache, past_key_values=past_key_values, use_cache=use_cache, output_attentions=flags.attentions,
            output_hidden_states=flags.hidden_states, return_dict=True,
        )
        output = with_cache(
            Seq2SeqModelOutput, cache_of(decoder_outputs) if use_cache else None,
            last_hidden_state=decoder_outputs.last_hidden_state, decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions, cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states, encoder_attentions=encoder_outputs.attentions,
        )
        return format_output(output, flags.return_dict)

    def _encoded(self, encoder_outputs, input_ids, attention_mask, inputs_embeds, flags) -> BaseModelOutput:
        """The encoder's output: computed now, or given (generate encodes once) as a ModelOutput whose first item is
        the last hidden state (any of transformers' encoder outputs) or a tuple (last_hidden_state, hidden_states,
        attentions)."""
        if encoder_outputs is None:
            return self.encoder(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                output_attentions=flags.attentions, output_hidden_states=flags.hidden_states,
                                return_dict=True)
        if isinstance(encoder_outputs, BaseModelOutput):
            return encoder_outputs
        if isinstance(encoder_outputs, ModelOutput) and encoder_outputs.get("last_hidden_state") is not None:
            return BaseModelOutput(last_hidden_state=encoder_outputs.last_hidden_state,
                                   hidden_states=encoder_outputs.get("hidden_states"),
                                   attentions=encoder_outputs.get("attentions"))
        if isinstance(encoder_outputs, torch.Tensor) or not isinstance(encoder_outputs, (tuple, list)) or not encoder_outputs:
            raise TypeError(
                "encoder_outputs must be a ModelOutput with a last_hidden_state or a tuple whose first item is the "
                f"encoder's last_hidden_state, got {type(encoder_outputs).__name__}"
            )
        return BaseModelOutput(
            last_hidden_state=encoder_outputs[0],
            hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
            attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None,
        )


class TinySeq2SeqForConditionalGeneration(TinySeq2SeqPreTrainedModel, GenerationMixin):
    _has_lm_head = True
    _tied_weights_keys = {
        "model.encoder.embed_tokens.weight": "model.shared.weight",
        "model.decoder.embed_tokens.weight": "model.shared.weight",
        "lm_head.weight": "model.shared.weight",
    }
    _keys_to_ignore_on_load_missing = ["final_logits_bias"]
    # forward takes num_items_in_batch (Trainer's gradient-accumulation-correct loss normalisation)
    accepts_loss_kwargs = True

    def __init__(self, config: TinySeq2SeqConfig):
        super().__init__(config)
        self.model = TinySeq2SeqModel(config)
        self.lm_head_transform = LMHeadTransform(config) if config.lm_head_transform else None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size) if config.final_logits_bias else None)
        self.post_init()

    def _validate_generated_length(self, generation_config, input_ids_length, *args, **kwargs):
        """Adds to transformers' checks, before any step runs: with learned or sinusoidal positions the decoder
        reads at most max_position_embeddings tokens, i.e. max_length - 1 (the last token is never fed back)."""
        super()._validate_generated_length(generation_config, input_ids_length, *args, **kwargs)
        if self.config.position_embedding_type not in ("learned", "sinusoidal"):
            return  # relative position buckets (T5) have no length limit
        limit = self.config.max_position_embeddings
        max_length = generation_config.max_length
        if max_length is None or max_length - 1 <= limit:
            return
        if input_ids_length > limit:
            raise ValueError(
                f"the decoder prompt (decoder_input_ids) holds {input_ids_length} tokens, more than "
                f"max_position_embeddings={limit}; shorten it to at most {limit} tokens"
            )
        raise ValueError(
            f"generation would feed the decoder {max_length - 1} tokens (decoder prompt {input_ids_length} + "
            f"max_new_tokens {max_length - input_ids_length} - 1), which exceeds max_position_embeddings={limit}; "
            f"use max_new_tokens <= {limit + 1 - input_ids_length}"
        )

    def generate(self, *args, **kwargs):
        """GenerationMixin.generate, after the one-time check of cached generation outside the tested transformers
        range (transformers_api.check_cached_generation)."""
        check_cached_generation(self)
        check_generation_kwargs(kwargs)
        return super().generate(*args, **kwargs)

    def get_encoder(self, modality=None):
        return self.model.encoder

    def get_decoder(self):
        return self.model.decoder

    def get_input_embeddings(self):
        return self.model.shared

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """Resizes `shared`, the decoder table when it is separate, the LM head (and its biases) together."""
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        size = embeddings.weight.shape[0]
        decoder = self.model.decoder
        if not self.config.share_encoder_decoder_embeddings and decoder.embed_tokens.weight.shape[0] != size:
            decoder.embed_tokens = self._get_resized_embeddings(decoder.embed_tokens, size, mean_resizing=mean_resizing)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = decoder.embed_tokens.weight
        self.lm_head.out_features = size
        if self.lm_head.bias is not None and self.lm_head.bias.shape[0] != size:
            self.lm_head.bias = nn.Parameter(self._resized_vector(self.lm_head.bias.data, size))
        if self.final_logits_bias is not None:
            self.register_buffer("final_logits_bias", self._resized_vector(self.final_logits_bias[0], size)[None])
        return embeddings

    @staticmethod
    def _resized_vector(old: torch.Tensor, size: int) -> torch.Tensor:
        """Keeps the first entries, zeros for new tokens."""
        new = old.new_zeros(size)
        keep = min(size, old.shape[0])
        new[:keep] = old[:keep]
        return new

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor):
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def _check_labels(self, labels, input_ids, inputs_embeds):
        if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
            raise ValueError(f"labels must be a 2-D tensor [batch, target_length], got {getattr(labels, 'shape', labels)!r}")
        check_labels(labels, num_classes=self.config.vocab_size)
        encoder_input = input_ids if input_ids is not None else inputs_embeds
        if isinstance(encoder_input, torch.Tensor) and encoder_input.dim() >= 2 and encoder_input.shape[0] != labels.shape[0]:
            raise ValueError(
                f"labels has batch size {labels.shape[0]} but the encoder input has batch size {encoder_input.shape[0]}"
            )

    def _head_input(self, hidden_states, logits_to_keep: int):
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        if self.config.scale_decoder_outputs:
            hidden_states = hidden_states * (self.config.hidden_size**-0.5)
        if self.lm_head_transform is not None:
            hidden_states = self.lm_head_transform(hidden_states)
        return hidden_states

    @runtime_products
    def _logits_and_loss(self, hidden_states, labels, num_items_in_batch, chunked: bool):
        """(logits, loss); chunked: the loss a chunk of tokens at a time, without the full logits (None)."""
        if labels is not None and labels.shape != hidden_states.shape[:2]:
            raise ValueError(f"labels have shape {tuple(labels.shape)} but the logits cover {tuple(hidden_states.shape[:2])}")
        if chunked:
            bias = self.lm_head.bias
            if self.final_logits_bias is not None:
                bias = self.final_logits_bias if bias is None else bias + self.final_logits_bias
            return None, linear_cross_entropy(hidden_states, self.lm_head.weight, labels, bias=bias,
                                              num_items_in_batch=num_items_in_batch)
        logits = self.lm_head(hidden_states)
        if self.final_logits_bias is not None:
            logits = logits + self.final_logits_bias.to(logits.device)
        if labels is None:
            return logits, None
        flat_logits = logits.float().reshape(-1, logits.shape[-1])
        flat_labels = labels.to(logits.device).reshape(-1)
        if num_items_in_batch is None:
            return logits, F.cross_entropy(flat_logits, flat_labels, ignore_index=-100)
        loss = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum")
        return logits, loss / torch.as_tensor(num_items_in_batch, device=loss.device, dtype=loss.dtype)

    @runtime_decoding(head="lm_head", tokens="decoder_input_ids")
    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, cache: Optional[Cache] = None, inputs_embeds=None, decoder_inputs_embeds=None,
                labels: Optional[torch.LongTensor] = None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, logits_to_keep: int = 0,
                num_items_in_batch: Optional[int] = None, skip_logits: Optional[bool] = None, *,
                past_key_values: Optional[Cache] = None, tokenizer=None, assistant_tokenizer=None):
        """tokenizer / assistant_tokenizer: handed on by generate() (stop_strings) with the model inputs; unused.
        labels: [batch, target_length] token ids, -100 = ignored. Without decoder inputs they are shifted right
        (decoder_start_token_id first) into decoder_input_ids. num_items_in_batch (given by Trainer under gradient
        accumulation): the loss is summed and divided by it instead of averaged over this batch.
        skip_logits: while training with labels the loss is computed a chunk of tokens at a time without the full
        logits (chunked_loss.py) and `logits` is None; skip_logits=False (and a tuple output, return_dict=False)
        returns the logits as usual."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if not return_dict and skip_logits is None:  # a tuple is read by position: the logits keep theirs
            skip_logits = False
        chunked = use_chunked_loss(skip_logits, labels, model=self, head=self.lm_head)
        if labels is not None:
            self._check_labels(labels, input_ids, inputs_embeds)
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask, encoder_outputs=encoder_outputs, cache=cache,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache, output_attentions=output_attentions, output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        hidden_states = self._head_input(outputs.last_hidden_state, logits_to_keep)
        logits, loss = self._logits_and_loss(hidden_states, labels, num_items_in_batch, chunked)
        output = with_cache(
            Seq2SeqLMOutput, cache_of(outputs), loss=loss, logits=logits,
            decoder_hidden_states=outputs.decoder_hidden_states, decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions, encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states, encoder_attentions=outputs.encoder_attentions,
        )
        return format_output(output, return_dict)

__all__ = [
    "TinySeq2SeqForConditionalGeneration",
    "TinySeq2SeqModel",
    "TinySeq2SeqPreTrainedModel",
    "shift_tokens_right",
]

"""The BERT-style encoder family: a transformer encoder and its task heads.

    ids -> embed_tokens + embed_token_types + embed_positions -> embed_norm -> dropout
        -> layers[0..N-1]  (x = norm(x + attn(x)); x = norm(x + mlp(x)))
        -> [pooler: tanh(dense(h[:, 0]))] -> head

ModernBERT is the same stack with other parts, chosen by the config: rotary positions instead of the position
table (one theta for global layers, one for local ones), pre-norm layers (x = x + attn(norm(x)); the embeddings'
norm is the first layer's, a final `norm` follows the last layer), local layers attending within a sliding
window, a gated feed-forward, no biases, and the MLM head's dense -> act -> norm in front of every task head.

Parameter names follow Llama habits so PEFT target_modules and device maps work as usual:
model.layers.N.self_attn.{q,k,v,o}_proj, model.layers.N.mlp.{up,down}_proj, model.layers.N.input_layernorm (the
norm after attention in post-LN) and model.layers.N.post_attention_layernorm (the norm after the feed-forward).

This file holds the model classes, the ones config.json's auto_map names: TinyEncoderModel and the task heads. Their
parts: encoder_embeddings.py (positions), encoder_layers.py (the residual layers), encoder_head_layers.py (pooler,
prediction transform, MLM and discriminator heads), re-exported here under their old names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import ModelOutput

from .configuration_encoder import TinyEncoderConfig
from .encoder_embeddings import SinusoidalPositionTable  # noqa: F401 (re-exported)
from .encoder_embeddings import check_index_tensor, position_table_of, rotary_embeddings_of
from .encoder_head_layers import (
    TinyEncoderDiscriminatorHead, TinyEncoderPooler, TinyEncoderPredictionHead, masked_lm_heads, pooled_states,
)
from .encoder_layers import TinyEncoderLayer, TinyEncoderPreNormLayer, norm_of
from .engines import VLLM, vllm_encoder_positions
from .masks import encoder_masks
from .modeling_base import HfTinyPreTrainedModel
from .runtime import runtime_stack
from .step import (
    LayerOutputs, check_attention_mask, check_positions, check_sequence_length, check_token_inputs, format_output,
    output_flags,
)
from .validation import check_answer_positions, check_labels, check_sequence_labels, sequence_problem_type


class TinyEncoderPreTrainedModel(HfTinyPreTrainedModel):
    config_class = TinyEncoderConfig
    base_model_prefix = "model"
    _no_split_modules = ["TinyEncoderLayer"]
    # The heads compute a mean loss themselves: Trainer must not pass num_items_in_batch.
    accepts_loss_kwargs = False

    def __init__(self, config: TinyEncoderConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        # the block this config builds, which device_map="auto" must keep whole (ModernBERT's is the pre-norm one)
        self._no_split_modules = ["TinyEncoderPreNormLayer" if config.norm_placement == "pre" else "TinyEncoderLayer"]

    def _format_output(self, output: ModelOutput, return_dict: Optional[bool]) -> Union[ModelOutput, tuple]:
        """The output as a ModelOutput, or as a tuple when return_dict (default: config.return_dict) is False."""
        return format_output(output, self.config.return_dict if return_dict is None else return_dict)

    def _encode(
        self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions, output_hidden_states
    ) -> BaseModelOutputWithPooling:
        """A head's run of its base model (self.model), always as a ModelOutput."""
        return self.model(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
            inputs_embeds=inputs_embeds, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, return_dict=True,
        )


class TinyEncoderWithLabelsHead(TinyEncoderPreTrainedModel):
    """The heads trained on one `labels` tensor (MLM, sequence and token classification): forward runs the encoder
    (self.model) and hands its output to the subclass's `_head(outputs, labels, attention_mask)`, which returns the
    ModelOutput."""

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels: Optional[torch.Tensor] = None, output_attentions=None, output_hidden_states=None,
                return_dict=None) -> Union[ModelOutput, tuple]:
        outputs = self._encode(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions, output_hidden_states
        )
        return self._format_output(self._head(outputs, labels, attention_mask), return_dict)


class TinyEncoderModel(TinyEncoderPreTrainedModel):
    def __init__(self, config: TinyEncoderConfig, add_pooling_layer: Optional[bool] = None):
        super().__init__(config)
        width = config.embedding_size
        self.embed_tokens = nn.Embedding(config.vocab_size, width, padding_idx=config.pad_token_id)
        self.embed_positions = position_table_of(config)
        self.embed_token_types = nn.Embedding(config.type_vocab_size, width) if config.type_vocab_size else None
        self.embed_norm = norm_of(config, width)
        self.dropout = nn.Dropout(config.hidden_dropout if config.embedding_dropout is None else config.embedding_dropout)
        self.embed_projection = nn.Linear(width, config.hidden_size) if config.project_embeddings else None
        pre_norm = config.norm_placement == "pre"
        layer_class = TinyEncoderPreNormLayer if pre_norm else TinyEncoderLayer
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_blocks()))
        self.norm = norm_of(config) if pre_norm else None
        self.rotary_emb, self.sliding_rotary_emb = rotary_embeddings_of(config)
        if add_pooling_layer is None:
            add_pooling_layer = config.add_pooling_layer
        self.pooler = TinyEncoderPooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def _check_inputs(self, input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids) -> tuple[int, int]:
        config = self.config
        # inputs_embeds are what get_input_embeddings() gives: embedding_size wide where that is narrower (ELECTRA, ALBERT)
        width = "hidden_size" if config.embedding_size == config.hidden_size else "embedding_size"
        shape = check_token_inputs(config, input_ids, inputs_embeds, embedding_width=width)
        if self.embed_positions is None:  # rotary positions exist for any position, as in official ModernBERT
            if position_ids is not None:
                check_positions(position_ids, *shape)
        elif position_ids is None:
            check_sequence_length(shape[1], limit=self.max_sequence_length, field="input sequence length")
        else:
            check_index_tensor(
                position_ids, field="position_ids", limit=config.max_position_embeddings,
                limit_name="max_position_embeddings", shape=shape,
            )
        if token_type_ids is not None and not config.type_vocab_size:
            raise ValueError("token_type_ids were given, but this encoder has no token types (type_vocab_size=0)")
        if token_type_ids is not None:
            check_index_tensor(
                token_type_ids, field="token_type_ids", limit=config.type_vocab_size,
                limit_name="type_vocab_size", shape=shape, vector_ok=True,
            )
        check_attention_mask(attention_mask, expected_shape=shape)
        return shape

    def layer_passes(self):
        """(block, attention type) in the order the blocks run: each once, or with ALBERT's sharing
        num_hidden_layers passes where pass i runs the inner_group_num blocks of group
        i * num_hidden_groups // num_hidden_layers; pass i attends as layer i's type."""
        config = self.config
        per_group = config.inner_group_num
        for i, layer_type in enumerate(config.attention_types()):
            group = i * config.num_hidden_groups // config.num_hidden_layers
            for block in self.layers[group * per_group : (group + 1) * per_group]:
                yield block, layer_type

    @property
    def max_sequence_length(self) -> int:
        """The longest input the position table covers (RoBERTa-style positions start after the padding row)."""
        config = self.config
        return config.max_position_embeddings - (config.pad_token_id + 1 if config.positions_from_padding else 0)

    def default_position_ids(self, input_ids: Optional[torch.Tensor], seq_len: int, device) -> torch.Tensor:
        """0, 1, 2, ... (BERT); with positions_from_padding (RoBERTa), pad_token_id + 1, + 2, ... counting
        non-padding tokens only, padding at pad_token_id; from embeddings alone the tokens count as real."""
        if not self.config.positions_from_padding:
            return torch.arange(seq_len, device=device)[None, :]
        pad = self.config.pad_token_id
        if input_ids is None:
            return torch.arange(pad + 1, seq_len + pad + 1, device=device)[None, :]
        real = input_ids.ne(pad).long()
        return torch.cumsum(real, dim=1) * real + pad

    def embed(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch, seq_len = inputs_embeds.shape[:2]
        device = inputs_embeds.device
        if token_type_ids is None and self.embed_token_types is not None:
            token_type_ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids, seq_len, device)
        # Same summation order as BERT (words + types, then positions): fp32 addition is not associative.
        hidden = inputs_embeds
        if self.embed_token_types is not None:
            hidden = hidden + self.embed_token_types(token_type_ids)
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions(position_ids)
        hidden = self.dropout(self.embed_norm(hidden))
        return self.embed_projection(hidden) if self.embed_projection is not None else hidden

    @runtime_stack
    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        use_cache: Optional[bool] = None,
    ) -> Union[BaseModelOutputWithPooling, tuple]:
        """use_cache: accepted and unused, as official BertModel does for an encoder (there is nothing to cache);
        vLLM's Transformers backend passes use_cache=False to every model."""
        flags = output_flags(self.config, output_attentions, output_hidden_states, return_dict)
        batch, seq_len = self._check_inputs(input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids)
        device = (input_ids if input_ids is not None else inputs_embeds).device
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids, seq_len, device)
        elif self.config._attn_implementation == VLLM:
            position_ids = vllm_encoder_positions(self.config, position_ids)

        hidden_states = self.embed(input_ids, token_type_ids, position_ids, inputs_embeds)
        masks = encoder_masks(self.config, attention_mask, batch_size=batch, length=seq_len, device=device)
        rotary = self.position_embeddings(hidden_states, position_ids)
        attention = [layer.self_attn for layer in self.layers] if flags.attentions else ()
        with LayerOutputs(flags, attention_modules=attention) as collected:
            for layer, layer_type in self.layer_passes():
                collected.add_hidden(hidden_states)
                hidden_states = layer(hidden_states, masks[layer_type], position_embeddings=rotary.get(layer_type),
                                      output_attentions=flags.attentions)
            if self.norm is not None:  # pre-norm: the last hidden states are normed, as official ModernBERT's
                hidden_states = self.norm(hidden_states)
            collected.add_hidden(hidden_states)

        output = BaseModelOutputWithPooling(
            last_hidden_state=hidden_states,
            pooler_output=self.pooler(hidden_states, attention_mask) if self.pooler is not None else None,
            hidden_states=collected.hidden_states,
            attentions=collected.attentions,
        )
        return format_output(output, flags.return_dict)

    def position_embeddings(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """{layer type: (cos, sin)} of the rotary positions; empty with a position table."""
        if self.rotary_emb is None:
            return {}
        tables = {}
        for layer_type in dict.fromkeys(self.config.attention_types()):
            own = self.sliding_rotary_emb if layer_type == "sliding_attention" else None
            tables[layer_type] = (own or self.rotary_emb)(hidden_states, position_ids)
        return tables


def _masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the vocabulary; positions labelled -100 (not masked) are ignored."""
    check_labels(labels, num_classes=logits.shape[-1], expected_shape=tuple(logits.shape[:2]))
    return CrossEntropyLoss()(logits.view(-1, logits.shape[-1]), labels.view(-1).to(logits.device))


class _WithMaskedLMHead:
    """The output embeddings of a model whose `lm_head` ends with the decoder (masked_lm_heads)."""

    _tied_weights_keys = {"lm_head.decoder.weight": "model.embed_tokens.weight"}
    # Tensor parallelism splits the (tied) word embeddings by vocabulary row; the decoder must then be split the same
    # way and gather its logits (tests/ecosystem/test_distributed.py)
    _tp_plan = {"lm_head.decoder": "colwise_gather_output"}

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head.decoder = new_embeddings


class TinyEncoderForMaskedLM(_WithMaskedLMHead, TinyEncoderPreTrainedModel):
    # forward takes num_items_in_batch (Trainer's gradient-accumulation-exact loss normalisation), as ModernBERT's
    accepts_loss_kwargs = True

    def __init__(self, config: TinyEncoderConfig):
        super().__init__(config)
        self.model = TinyEncoderModel(config, add_pooling_layer=False)
        self.head, self.lm_head = masked_lm_heads(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels: Optional[torch.Tensor] = None, output_attentions=None, output_hidden_states=None,
                return_dict=None, num_items_in_batch=None) -> Union[MaskedLMOutput, tuple]:
        """labels: [batch, seq] masked-LM targets (-100 = not masked). The loss is transformers' ForMaskedLMLoss
        (ModernBERT's): from float32 logits, and per item of num_items_in_batch when given."""
        outputs = self._encode(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions, output_hidden_states
        )
        logits = self.lm_head(_transformed(self.head, outputs.last_hidden_state))
        loss = None
        if labels is not None:  # self.loss_function: transformers' ForMaskedLMLoss, by the class name
            check_labels(labels, num_classes=logits.shape[-1], expected_shape=tuple(logits.shape[:2]))
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                      num_items_in_batch=num_items_in_batch)
        output = MaskedLMOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                attentions=outputs.attentions)
        return self._format_output(output, return_dict)


@dataclass
class TinyEncoderForPreTrainingOutput(ModelOutput):
    """BERT pretraining outputs: the MLM logits and the next-sentence logits (0: B follows A, 1: B is random)."""

    loss: Optional[torch.Tensor] = None
    prediction_logits: Optional[torch.Tensor] = None
    seq_relationship_logits: Optional[torch.Tensor] = None
    hidden_states: Optional[tuple[torch.Tensor, ...]] = None
    attentions: Optional[tuple[torch.Tensor, ...]] = None

    @property
    def sop_logits(self) -> Optional[torch.Tensor]:
        """ALBERT's name for the same head's logits (its sentence-order head: 0 = in order, 1 = swapped)."""
        return self.seq_relationship_logits


class TinyEncoderForPreTraining(_WithMaskedLMHead, TinyEncoderPreTrainedModel):
    """BERT's pretraining model: the MLM head on every token and the next-sentence head on the pooled output
    (ALBERT's sentence-order head is the same linear layer, after next_sentence_dropout; its labels come as
    next_sentence_label or, as official ALBERT names them, sentence_order_label, and its logits are also the
    output's sop_logits). The loss (when both labels and next_sentence_label are given) is the sum of the two
    cross-entropies."""

    def __init__(self, config: TinyEncoderConfig):
        super().__init__(config)
        self.model = TinyEncoderModel(config, add_pooling_layer=True)
        self.head, self.lm_head = masked_lm_heads(config)
        self.next_sentence_dropout = nn.Dropout(config.next_sentence_dropout)
        self.next_sentence = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels: Optional[torch.Tensor] = None, next_sentence_label: Optional[torch.Tensor] = None,
                output_attentions=None, output_hidden_states=None, return_dict=None, **other_names):
        """labels: [batch, seq] masked-LM targets (-100 = not masked); next_sentence_label: [batch], 0 = the second
        segment follows the first, 1 = random (ALBERT: sentence_order_label, 0 = in order, 1 = swapped).
        sentence_order_label arrives as a keyword outside the signature: Trainer computes an evaluation loss only
        when a batch holds every label its model's signature names, and a batch holds one of the two names (an
        ALBERT batch needs TrainingArguments(label_names=["labels", "sentence_order_label"]), docs/compatibility.md)."""
        sentence_order_label = other_names.pop("sentence_order_label", None)
        if other_names:
            raise TypeError(f"{type(self).__name__}.forward() got unexpected keyword arguments {sorted(other_names)}")
        if sentence_order_label is not None:
            if next_sentence_label is not None:
                raise ValueError("pass next_sentence_label or sentence_order_label (ALBERT's name for it), not both")
            next_sentence_label = sentence_order_label
        outputs = self._encode(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions, output_hidden_states
        )
        prediction_logits = self.lm_head(_transformed(self.head, outputs.last_hidden_state))
        seq_relationship_logits = self.next_sentence(self.next_sentence_dropout(outputs.pooler_output))
        loss = None
        if labels is not None and next_sentence_label is not None:
            check_labels(next_sentence_label, num_classes=2, expected_shape=(prediction_logits.shape[0],),
                         field="next_sentence_label")
            next_sentence_loss = CrossEntropyLoss()(
                seq_relationship_logits.view(-1, 2), next_sentence_label.view(-1).to(seq_relationship_logits.device)
            )
            loss = _masked_lm_loss(prediction_logits, labels) + next_sentence_loss
        output = TinyEncoderForPreTrainingOutput(
            loss=loss, prediction_logits=prediction_logits, seq_relationship_logits=seq_relationship_logits,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )
        return self._format_output(output, return_dict)


class TinyEncoderForReplacedTokenDetection(TinyEncoderWithLabelsHead):
    """ELECTRA's discriminator: for every token, the logit that it was replaced. labels: [batch, seq], 1 =
    replaced, 0 = original; the loss is binary cross-entropy over the tokens the attention mask keeps (all tokens
    without a mask), as official ELECTRA computes it."""

    def __init__(self, config: TinyEncoderConfig):
        super().__init__(config)
        self.model = TinyEncoderModel(config, add_pooling_layer=False)
        self.discriminator = TinyEncoderDiscriminatorHead(config)
        self.post_init()

    def _head(self, outputs, labels, attention_mask) -> TokenClassifierOutput:
        logits = self.discriminator(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            check_labels(labels, num_classes=2, expected_shape=tuple(logits.shape))
            # float32 labels, as official ELECTRA's (.float()): the loss runs in float32 beside bf16 logits
            flat_logits, flat_labels = logits.reshape(-1), labels.to(logits.device).float().reshape(-1)
            if attention_mask is not None:
                kept = attention_mask.to(logits.device).reshape(-1) == 1
                flat_logits, flat_labels = flat_logits[kept], flat_labels[kept]
            loss = BCEWithLogitsLoss()(flat_logits, flat_labels)
        return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _transformed(head: Optional[TinyEncoderPredictionHead], hidden_states: torch.Tensor) -> torch.Tensor:
    """The hidden states through the head transform a head starts with (head_transform, shared_head), if any."""
    return hidden_states if head is None else head(hidden_states)


def _classifier_dropout(config: TinyEncoderConfig) -> nn.Dropout:
    """The classification heads' dropout: classifier_dropout, or hidden_dropout when unset (as in BERT)."""
    return nn.Dropout(config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout)


class TinyEncoderForSequenceClassification(TinyEncoderWithLabelsHead):
    """Pooled output -> dropout -> linear; with shared_head the pooled states go through the shared `head` instead of
    a pooler (ModernBERT's), with pre_classifier through the classifier's own pooler, `pre_classifier` (RoBERTa's,
    ELECTRA's, DistilBERT's), instead of the encoder's. The loss follows config.problem_type as in BERT:
    "regression" (MSE), "single_label_classification" (cross-entropy) or "multi_label_classification" (BCE with logits); when unset
    it is inferred from num_labels and the labels' dtype on the first call, and stored in the config."""

    def __init__(self, config: TinyEncoderConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = TinyEncoderModel(config, add_pooling_layer=not (config.shared_head or config.pre_classifier))
        self.head = TinyEncoderPredictionHead(config) if config.shared_head else None
        self.pre_classifier = TinyEncoderPooler(config) if config.pre_classifier else None
        rate = config.sequence_classifier_dropout
        self.dropout = nn.Dropout(rate) if rate is not None else _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        config = self.config
        check_sequence_labels(
            labels, problem_type=config.problem_type, batch_size=logits.shape[0], num_labels=self.num_labels
        )
        config.problem_type = sequence_problem_type(config.problem_type, self.num_labels, labels)
        labels = labels.to(logits.device)
        if config.problem_type == "regression":
            # float labels as they are, as official's (MSE then runs in float32 beside bf16 logits); integers as float32
            labels = labels if labels.is_floating_point() else labels.float()
            if self.num_labels == 1:
                return MSELoss()(logits.squeeze(), labels.squeeze())
            return MSELoss()(logits, labels)
        if config.problem_type == "single_label_classification":
            return CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.view(-1))
        if config.problem_type == "multi_label_classification":
            return BCEWithLogitsLoss()(logits, labels if labels.is_floating_point() else labels.float())
        raise ValueError(
            f"config.problem_type {config.problem_type!r} is not one of 'regression', "
            "'single_label_classification', 'multi_label_classification'"
        )

    def _pooled(self, outputs, attention_mask) -> torch.Tensor:
        hidden_states = outputs.last_hidden_state
        if self.head is not None:
            return self.head(pooled_states(hidden_states, attention_mask, self.config.classifier_pooling))
        pooler = self.pre_classifier if self.pre_classifier is not None else self.model.pooler
        if self.config.dropout_before_pooler:  # RoBERTa: dropout(h[:, 0]) -> dense -> tanh, then as below
            return pooler(self.dropout(hidden_states[:, :1]))
        return outputs.pooler_output if self.pre_classifier is None else pooler(hidden_states, attention_mask)

    def _head(self, outputs, labels, attention_mask) -> SequenceClassifierOutput:
        logits = self.classifier(self.dropout(self._pooled(outputs, attention_mask)))
        loss = self._loss(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class TinyEncoderForTokenClassification(TinyEncoderWithLabelsHead):
    def __init__(self, config: TinyEncoderConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = TinyEncoderModel(config, add_pooling_layer=False)
        self.head = TinyEncoderPredictionHead(config) if config.head_transform else None
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def _head(self, outputs, labels, attention_mask) -> TokenClassifierOutput:
        logits = self.classifier(self.dropout(_transformed(self.head, outputs.last_hidden_state)))
        loss = None
        if labels is not None:
            # Tokens labelled -100 (padding, continuation word pieces) are ignored.
            check_labels(labels, num_classes=self.num_labels, expected_shape=tuple(logits.shape[:2]))
            loss = CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.view(-1).to(logits.device))
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class TinyEncoderForQuestionAnswering(TinyEncoderPreTrainedModel):
    """Extractive QA: a linear layer gives start and end logits for every token (config.num_labels must be 2)."""

    def __init__(self, config: TinyEncoderConfig):
        if config.num_labels != 2:
            raise ValueError(
                f"{type(self).__name__} predicts a start and an end logit per token, so config.num_labels must be 2, "
                f"got {config.num_labels}"
            )
        super().__init__(config)
        self.model = TinyEncoderModel(config, add_pooling_layer=False)
        self.head = TinyEncoderPredictionHead(config) if config.head_transform else None
        self.dropout = nn.Dropout(config.qa_dropout)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                start_positions: Optional[torch.Tensor] = None, end_positions: Optional[torch.Tensor] = None,
                output_attentions=None, output_hidden_states=None, return_dict=None):
        """start_positions / end_positions: [batch] token indices of the answer span (a position past the sequence is left out of the loss, as in BERT)."""
        outputs = self._encode(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions, output_hidden_states
        )
        logits = self.qa_outputs(self.dropout(_transformed(self.head, outputs.last_hidden_state)))
        start_logits, end_logits = (part.squeeze(-1).contiguous() for part in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            check_answer_positions(start_positions, batch_size=logits.shape[0], field="start_positions")
            check_answer_positions(end_positions, batch_size=logits.shape[0], field="end_positions")
            # As in BERT: positions outside the input (e.g. an answer cut off by truncation) are clamped to
            # seq_len and ignored by the loss.
            ignored_index = start_logits.size(1)
            start = start_positions.reshape(-1).to(logits.device).clamp(0, ignored_index)
            end = end_positions.reshape(-1).to(logits.device).clamp(0, ignored_index)
            loss_fct = CrossEntropyLoss(ignore_index=ignored_index)
            loss = (loss_fct(start_logits, start) + loss_fct(end_logits, end)) / 2
        output = QuestionAnsweringModelOutput(
            loss=loss, start_logits=start_logits, end_logits=end_logits,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )
        return self._format_output(output, return_dict)


__all__ = [
    "TinyEncoderPreTrainedModel",
    "TinyEncoderModel",
    "TinyEncoderForMaskedLM",
    "TinyEncoderForPreTraining",
    "TinyEncoderForReplacedTokenDetection",
    "TinyEncoderForSequenceClassification",
    "TinyEncoderForTokenClassification",
    "TinyEncoderForQuestionAnswering",
]

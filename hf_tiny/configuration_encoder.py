"""Configuration of the BERT-style encoder family (model_type "hf_tiny_encoder")."""

from __future__ import annotations

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from .layer_types import check_layer_types
from .rope import rope_parameter_sets, rotary_dim, standardize_rope_parameters
from .validation import check_bool, check_choice, check_divisible, check_finite_fields, check_positive, check_positive_number
from .validation import check_non_negative, check_probability, check_token_ids, check_unsupported_field, init_arguments
from .validation import store_init_fields

# The fields of mechanisms BERT-style encoders do not have (ModernBERT's), with the value that means "not used". A
# config holds such a field only when its value differs (so BERT-era config.json files stay as they are); reading
# one it does not hold gives this value (a class attribute). rope_parameters, held with position_embedding_type
# "rope" only, is not among them: transformers standardizes a config's rope_parameters whenever it has one.
OPTIONAL_FIELDS = dict(
    position_embedding_type="absolute", layer_types=None, sliding_window=None, norm_placement="post", norm_bias=True,
    mlp_gated=False, mlp_bias=True, activation_dropout=0.0, embedding_dropout=None, head_transform=False,
    classifier_pooling="cls", classifier_bias=True, classifier_activation=None, decoder_bias=True, shared_head=False,
    pre_classifier=False, use_cache=True,
)
POSITION_EMBEDDING_TYPES = ("absolute", "rope")
NORM_PLACEMENTS = ("post", "pre")
CLASSIFIER_POOLINGS = ("cls", "mean")

# The encoder's layer types (ModernBERT's global and local layers); the causal family also has chunked ones.
LAYER_TYPES = ("full_attention", "sliding_attention")


class TinyEncoderConfig(PretrainedConfig):
    """A post-LN transformer encoder: word + learned absolute position + token-type embeddings, LayerNorm,
    N blocks of (self-attention, GELU feed-forward), optional tanh pooler. The field names are the transformers
    standard ones; `hidden_dropout` / `attention_dropout` are BERT's `hidden_dropout_prob` /
    `attention_probs_dropout_prob`.

    Variant fields (each needed by a real checkpoint family):
        positions_from_padding: RoBERTa's position ids: each token's position counts the non-padding tokens up
            to it, starting at pad_token_id + 1; padding tokens take position pad_token_id (the padding row of
            embed_positions). Sequences may then be max_position_embeddings - pad_token_id - 1 tokens long.
        dropout_before_pooler: sequence classification applies dropout to the first token's hidden state before
            the pooler's dense layer too (RoBERTa's classification head: dropout, dense, tanh, dropout, out_proj).
        embedding_size: width of the embeddings (ELECTRA, ALBERT), projected to hidden_size after their norm
            (`embed_projection`); the MLM head maps back to it (None: hidden_size, no projection).
        add_pooling_layer: whether the base model has a pooler (DistilBERT and ELECTRA have none; the sequence
            classifier always has one, the encoder's or, with pre_classifier, its own). pooler_act: its activation
            (BERT tanh, DistilBERT relu, ELECTRA gelu).
        type_vocab_size: 0 = no token-type embeddings (DistilBERT).
        sinusoidal_positions: the position table starts as sin/cos (DistilBERT's sinusoidal_pos_embds), written at
            init; it is trained like any parameter, as in official transformers 5.
        sequence_classifier_dropout: dropout of the sequence classifier where it differs from classifier_dropout
            (DistilBERT's seq_classif_dropout); qa_dropout: dropout before the QA outputs (DistilBERT).
        project_embeddings: a projection embedding_size -> hidden_size after the embeddings (None: when the two
            differ; ALBERT always has one).
        num_hidden_groups / inner_group_num: ALBERT's cross-layer parameter sharing. The model runs
            num_hidden_layers passes; pass i runs group i * num_hidden_groups // num_hidden_layers, a stack of
            inner_group_num blocks, so there are num_hidden_groups * inner_group_num blocks of weights (None: one
            group per layer, no sharing). num_hidden_groups must divide num_hidden_layers.
        next_sentence_dropout: dropout before the next-sentence / sentence-order head (ALBERT's SOP head uses
            classifier_dropout_prob; BERT has none).

    Optional fields (OPTIONAL_FIELDS; ModernBERT's mechanisms), held only when set to something else than their
    default:
        position_embedding_type: "absolute" (the learned table) or "rope": rotary positions in every attention, no
            position table; rope_parameters is then one rope dict, or one per layer type ({"full_attention": ...,
            "sliding_attention": ...}: ModernBERT's global and local theta).
        layer_types: each layer's attention, "full_attention" or "sliding_attention" (None: all full);
            sliding_window: a sliding layer's query sees the keys at most sliding_window positions before or after
            it (transformers' bidirectional window; ModernBERT's local_attention // 2).
        norm_placement: "post" (BERT: x = norm(x + f(x))) or "pre" (ModernBERT: x = x + f(norm(x)); the embeddings'
            norm is the first layer's input norm, and a final norm follows the last layer). norm_bias: the
            LayerNorms' additive bias (ModernBERT has none).
        mlp_gated: the gated feed-forward down(act(gate(x)) * up(x)) (ModernBERT's GeGLU); mlp_bias: biases of
            its projections; activation_dropout: dropout of the feed-forward's hidden activations.
        embedding_dropout: the embeddings' dropout where it differs from hidden_dropout (None: hidden_dropout).
        head_transform: every task head starts with the MLM head's dense -> activation -> LayerNorm (ModernBERT's
            prediction head): the pooler ends with the norm, token classification and QA put it before their
            classifier. classifier_pooling: what the pooler reads, the first token ("cls") or the mean over the
            real tokens ("mean"). classifier_bias: the bias of those dense layers (pooler, MLM transform);
            classifier_activation: the activation of the MLM and token / QA transforms (None: hidden_act; the
            pooler's is pooler_act). decoder_bias: the MLM decoder's bias.
        shared_head (with head_transform): that transform is one module, `head`, in every task model (the MLM's
            before its decoder, the sequence classifier's after its pooling instead of a pooler), as ModernBERT
            names it, so that a classifier loaded from a masked-LM folder starts from the trained transform. Set by
            the ModernBERT converter; without it (folders converted before) the MLM's transform is
            `lm_head.dense` / `lm_head.layer_norm` and the sequence classifier's is the pooler's. (BERT's pretraining
            model, which ModernBERT has none of, keeps its next-sentence pooler beside `head`.)
        pre_classifier: the sequence classifier's pooler is its own module, `pre_classifier` (beside `classifier`),
            not the encoder's `model.pooler`, as RoBERTa, ELECTRA and DistilBERT hold that dense layer in their
            classification head: loaded from a base folder it starts fresh as official's does, and PEFT's
            task_type="SEQ_CLS" (modules_to_save "classifier", matched by the end of a name) trains and saves it
            as it does official's. Set by those converters; folders converted before keep `model.pooler`.
        use_cache: read by nothing (an encoder has no cache), kept as official BERT-era configs keep it, so that
            from_pretrained(..., use_cache=False) and a config.json that says so load as official's do.
    """

    model_type = "hf_tiny_encoder"
    # Parallel plans, module paths relative to TinyEncoderModel (see tests/ecosystem/test_distributed.py, which runs them).
    # Tensor parallelism (DistributedConfig(tp_size=N)): attention heads and feed-forward columns split across ranks.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    # FSDP2 units (DistributedConfig(fsdp_size=N)); transformers' default plan names a final `norm` we do not have.
    base_model_fsdp_plan = {"embed_tokens": "free_full_weight", "layers.*": "free_full_weight"}

    def __init__(
        self, vocab_size: int = 30522, hidden_size: int = 768, num_hidden_layers: int = 12, num_attention_heads: int = 12,
        intermediate_size: int = 3072, hidden_act: str = "gelu", hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1, max_position_embeddings: int = 512, type_vocab_size: int = 2,
        layer_norm_eps: float = 1e-12, initializer_range: float = 0.02, pad_token_id: int | None = 0,
        classifier_dropout: float | None = None, attention_bias: bool = True, tie_word_embeddings: bool = True,
        positions_from_padding: bool = False, dropout_before_pooler: bool = False, embedding_size: int | None = None,
        add_pooling_layer: bool = True, pooler_act: str = "tanh", sinusoidal_positions: bool = False,
        sequence_classifier_dropout: float | None = None, qa_dropout: float = 0.0, project_embeddings: bool | None = None,
        num_hidden_groups: int | None = None, inner_group_num: int = 1, next_sentence_dropout: float = 0.0, **kwargs,
    ):
        owner = type(self).__name__
        optional = {name: kwargs.pop(name, default) for name, default in OPTIONAL_FIELDS.items()}
        rope_parameters = kwargs.pop("rope_parameters", None)
        values = {**init_arguments({k: v for k, v in locals().items() if k not in ("optional", "owner")}), **optional}
        check_finite_fields(owner, values)
        check_positive(owner, vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                       num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                       max_position_embeddings=max_position_embeddings)
        check_divisible(owner, "hidden_size", hidden_size, "num_attention_heads", num_attention_heads)
        check_choice(owner, "hidden_act", hidden_act, sorted(ACT2FN))
        check_unsupported_field(owner, kwargs, "rope_scaling", (None,), "give rope_parameters with position_embedding_type='rope'")
        for field in ("is_decoder", "add_cross_attention"):  # official BERT's causal / cross-attention decoder
            check_unsupported_field(owner, kwargs, field, (False,), "the encoder attends both ways and has no "
                                    "cross-attention; for a decoder use TinyCausalConfig or TinySeq2SeqConfig")
        _check_dropouts_and_norms(owner, values)
        _check_optional_fields(owner, values)
        values.update(_embedding_fields(owner, values))
        values["num_hidden_groups"] = _layer_sharing(owner, values)
        check_token_ids(owner, vocab_size, pad_token_id=pad_token_id)
        _check_positions_from_padding(owner, values)
        standardized = _rope_parameters(owner, values)
        store_init_fields(self, TinyEncoderConfig.__init__, values)
        for name, default in OPTIONAL_FIELDS.items():
            if values[name] != default:
                setattr(self, name, values[name])
        super().__init__(**kwargs)
        if standardized is not None:  # after transformers' __init__, which would standardize it its own way
            self.rope_parameters = standardized

    def num_blocks(self) -> int:
        """Blocks of weights: num_hidden_layers, or fewer when layers share them (ALBERT)."""
        return self.num_hidden_groups * self.inner_group_num

    def attention_types(self) -> list[str]:
        """Each layer pass's attention: layer_types, or full attention everywhere (BERT-style encoders hold none)."""
        return list(self.layer_types) if self.layer_types is not None else ["full_attention"] * self.num_hidden_layers

    def rope_parameters_for(self, layer_type: str) -> dict:
        """The rope parameters a layer of this type rotates with (position_embedding_type "rope" only)."""
        if set(self.rope_parameters) == set(LAYER_TYPES):
            return self.rope_parameters[layer_type]
        return self.rope_parameters


for _name, _default in OPTIONAL_FIELDS.items():  # what a config that does not hold the field reads
    setattr(TinyEncoderConfig, _name, _default)


def _check_dropouts_and_norms(owner: str, values: dict) -> None:
    check_probability(owner, hidden_dropout=values["hidden_dropout"], attention_dropout=values["attention_dropout"],
                      qa_dropout=values["qa_dropout"], next_sentence_dropout=values["next_sentence_dropout"])
    for name in ("classifier_dropout", "sequence_classifier_dropout"):
        if values[name] is not None:
            check_probability(owner, **{name: values[name]})
    check_positive_number(owner, layer_norm_eps=values["layer_norm_eps"], initializer_range=values["initializer_range"])
    check_choice(owner, "pooler_act", values["pooler_act"], sorted(ACT2FN))
    check_bool(owner, add_pooling_layer=values["add_pooling_layer"], sinusoidal_positions=values["sinusoidal_positions"],
               positions_from_padding=values["positions_from_padding"],
               dropout_before_pooler=values["dropout_before_pooler"], attention_bias=values["attention_bias"],
               tie_word_embeddings=values["tie_word_embeddings"])


def _embedding_fields(owner: str, values: dict) -> dict:
    """embedding_size and project_embeddings filled in (ELECTRA, ALBERT factorize the embeddings) and checked."""
    check_non_negative(owner, "0 = no token types", type_vocab_size=values["type_vocab_size"])
    hidden = values["hidden_size"]
    width = hidden if values["embedding_size"] is None else values["embedding_size"]
    check_positive(owner, embedding_size=width)
    project = width != hidden if values["project_embeddings"] is None else values["project_embeddings"]
    check_bool(owner, project_embeddings=project)
    if width != hidden and not project:
        raise ValueError(f"{owner}: embedding_size={width} differs from hidden_size={hidden}, which needs project_embeddings=True")
    if values["sinusoidal_positions"] and width % 2:
        raise ValueError(f"{owner}: sinusoidal_positions needs an even embedding_size, got {width}")
    return {"embedding_size": width, "project_embeddings": project}


def _layer_sharing(owner: str, values: dict) -> int:
    """num_hidden_groups filled in (ALBERT's sharing; default: one group per layer) and checked."""
    layers = values["num_hidden_layers"]
    groups = layers if values["num_hidden_groups"] is None else values["num_hidden_groups"]
    check_positive(owner, num_hidden_groups=groups, inner_group_num=values["inner_group_num"])
    if layers % groups:
        raise ValueError(
            f"{owner}: num_hidden_groups={groups} must divide num_hidden_layers={layers} (each group of shared layers "
            "runs for the same number of passes)"
        )
    return groups


def _check_optional_fields(owner: str, values: dict) -> None:
    """ModernBERT's fields (OPTIONAL_FIELDS) checked; layer_types filled in when sliding_window is set."""
    for name, choices in (("position_embedding_type", POSITION_EMBEDDING_TYPES), ("norm_placement", NORM_PLACEMENTS),
                          ("classifier_pooling", CLASSIFIER_POOLINGS)):
        check_choice(owner, name, values[name], choices)
    check_bool(owner, **{name: values[name] for name in ("norm_bias", "mlp_gated", "mlp_bias", "head_transform",
                                                         "classifier_bias", "decoder_bias", "shared_head",
                                                         "pre_classifier", "use_cache")})
    _check_shared_head(owner, values)
    check_probability(owner, activation_dropout=values["activation_dropout"])
    if values["embedding_dropout"] is not None:
        check_probability(owner, embedding_dropout=values["embedding_dropout"])
    if values["classifier_activation"] is not None:
        check_choice(owner, "classifier_activation", values["classifier_activation"], sorted(ACT2FN))
    if values["sliding_window"] is not None:
        check_positive(owner, sliding_window=values["sliding_window"])
    if values["layer_types"] is not None or values["sliding_window"] is not None:
        values["layer_types"] = check_layer_types(owner, values["layer_types"], values["num_hidden_layers"],
                                                  values["sliding_window"])
        other = sorted(set(values["layer_types"]) - set(LAYER_TYPES))
        if other:
            raise ValueError(f"{owner}: the encoder's layer_types are {list(LAYER_TYPES)}; got {other}")
    if values["position_embedding_type"] == "rope" and (values["positions_from_padding"] or values["sinusoidal_positions"]):
        raise ValueError(
            f"{owner}: position_embedding_type='rope' has no position table, so positions_from_padding="
            f"{values['positions_from_padding']} / sinusoidal_positions={values['sinusoidal_positions']} must be False"
        )


def _check_shared_head(owner: str, values: dict) -> None:
    """shared_head names the head_transform's module: it needs one, of one width in every task model."""
    if not values["shared_head"]:
        return
    if not values["head_transform"]:
        raise ValueError(f"{owner}: shared_head=True shares the head transform, which needs head_transform=True "
                         f"(got head_transform={values['head_transform']})")
    if values["embedding_size"] not in (None, values["hidden_size"]):
        raise ValueError(f"{owner}: shared_head=True needs one transform width, but embedding_size="
                         f"{values['embedding_size']} differs from hidden_size={values['hidden_size']} (the MLM's "
                         "transform maps back to embedding_size)")
    if values["pre_classifier"]:
        raise ValueError(f"{owner}: shared_head=True pools through the shared `head`, so pre_classifier=True (a "
                         "pooler of the sequence classifier's own) has no place; set one of them False")
    if values["dropout_before_pooler"]:
        raise ValueError(f"{owner}: shared_head=True has no pooler, so dropout_before_pooler=True (RoBERTa's pooler "
                         "dropout) has nothing to act on; set it False")


def _rope_parameters(owner: str, values: dict) -> dict | None:
    """rope_parameters standardized (one dict, or one per layer type) for position_embedding_type "rope"; None
    otherwise, where giving them is an error."""
    params, max_positions = values["rope_parameters"], values["max_position_embeddings"]
    if values["position_embedding_type"] != "rope":
        if params is not None:
            raise ValueError(f"{owner}: rope_parameters={params!r} need position_embedding_type='rope' (this encoder "
                             f"has position_embedding_type={values['position_embedding_type']!r})")
        return None
    head_dim = values["hidden_size"] // values["num_attention_heads"]
    if isinstance(params, dict) and set(params) & set(LAYER_TYPES):
        unknown = sorted(set(params) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"{owner}: rope_parameters keyed by layer type may hold only {list(LAYER_TYPES)}; got keys {unknown}")
        standardized = {kind: standardize_rope_parameters(params.get(kind), max_position_embeddings=max_positions,
                                                          owner=f"{owner} rope_parameters[{kind!r}]") for kind in LAYER_TYPES}
    else:
        standardized = standardize_rope_parameters(params, max_position_embeddings=max_positions, owner=owner)
    for kind_params in rope_parameter_sets(standardized):
        rotary_dim(kind_params, head_dim, owner=owner)
    return standardized


def _check_positions_from_padding(owner: str, values: dict) -> None:
    if not values["positions_from_padding"]:
        return
    pad, limit = values["pad_token_id"], values["max_position_embeddings"]
    if pad is None:
        raise ValueError(f"{owner}: positions_from_padding=True needs a pad_token_id, got pad_token_id=None")
    if limit <= pad + 1:
        raise ValueError(
            f"{owner}: positions_from_padding=True numbers positions from pad_token_id + 1 = {pad + 1}, so "
            f"max_position_embeddings={limit} leaves no room for a single token"
        )


__all__ = ["TinyEncoderConfig"]

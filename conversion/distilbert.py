"""DistilBERT (transformers `model_type: distilbert`) <-> hf_tiny encoder: the BERT table with DistilBERT's names.

    python -m conversion [distilbert] SRC DST              official DistilBERT folder -> hf_tiny folder
    python -m conversion [distilbert] SRC DST --reverse    hf_tiny encoder folder -> official DistilBERT

What differs from BERT: no token types (type_vocab_size 0), no pooler in the base model, its own tensor and
config names, the sequence classifier `pre_classifier` -> ReLU -> dropout(seq_classif_dropout) -> `classifier`
(hf_tiny's classifier's own pooler, `pre_classifier`, with pooler_act="relu"), dropout before the QA outputs, and
optionally a fixed sinusoidal position table (`sinusoidal_pos_embds`; the checkpoint stores it, hf_tiny writes the
same table at init).
"""

from __future__ import annotations

from .bert import ENCODER_POOLER_DENSE, TASK_PARTS, EncoderFamily, EncoderVariant, MaskedLMNames, class_parts
from .pipeline import entry_points

CONFIG_FIELDS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "hidden_dim": "intermediate_size",
    "activation": "hidden_act",
    "dropout": "hidden_dropout",
    "attention_dropout": "attention_dropout",
    "max_position_embeddings": "max_position_embeddings",
    "initializer_range": "initializer_range",
    "pad_token_id": "pad_token_id",
    "tie_word_embeddings": "tie_word_embeddings",
    "seq_classif_dropout": "sequence_classifier_dropout",
    "qa_dropout": "qa_dropout",
    "sinusoidal_pos_embds": "sinusoidal_positions",
    "id2label": "id2label",
    "label2id": "label2id",
    "problem_type": "problem_type",
}
LAYER_MODULES = {
    "attention.q_lin": "self_attn.q_proj",
    "attention.k_lin": "self_attn.k_proj",
    "attention.v_lin": "self_attn.v_proj",
    "attention.out_lin": "self_attn.o_proj",
    "sa_layer_norm": "input_layernorm",
    "ffn.lin1": "mlp.up_proj",
    "ffn.lin2": "mlp.down_proj",
    "output_layer_norm": "post_attention_layernorm",
}

DISTILBERT = EncoderVariant(
    model_type="distilbert",
    class_prefix="DistilBert",
    masked_lm=MaskedLMNames("vocab_transform", "vocab_layer_norm", decoder="vocab_projector"),
    parts={"classification_head": {"pre_classifier": ENCODER_POOLER_DENSE, "classifier": "classifier"}, **TASK_PARTS},
    class_parts=class_parts(base_pooler=False, sequence=("classification_head",)),
    fixed_config={
        "type_vocab_size": 0, "layer_norm_eps": 1e-12, "add_pooling_layer": False, "pooler_act": "relu",
        "classifier_dropout": None, "pre_classifier": True,
    },
    layout_fields=("pre_classifier",),
    config_fields=CONFIG_FIELDS,
    layer_path="transformer.layer.{i}",
    layer_modules=LAYER_MODULES,
    embedding_tables={"embeddings.position_embeddings": "embed_positions"},
)


FAMILY = EncoderFamily(DISTILBERT, "hf_tiny_encoder (BERT-style encoder, DistilBERT layout)",
                       markers=("transformer.layer.0.attention.q_lin.weight",))
convert, convert_back = entry_points(FAMILY)

"""ALBERT (transformers `model_type: albert`) <-> hf_tiny encoder: the BERT table with ALBERT's names and sharing.

    python -m conversion [albert] SRC DST              official ALBERT folder -> hf_tiny folder
    python -m conversion [albert] SRC DST --reverse    hf_tiny encoder folder -> official ALBERT

What differs from BERT: factorized embeddings always projected (`encoder.embedding_hidden_mapping_in` ->
`embed_projection`), cross-layer parameter sharing (num_hidden_groups groups of inner_group_num blocks; block
(g, j) of `albert_layer_groups.{g}.albert_layers.{j}` is hf_tiny's `layers.{g * inner_group_num + j}`), the
pooler named `pooler`, and the sentence-order head (`sop_classifier.classifier` -> `next_sentence`, after
dropout(classifier_dropout_prob)); its labels go to `next_sentence_label`.
"""

from __future__ import annotations

from .bert import BERT, CONFIG_FIELDS, TASK_PARTS, EncoderFamily, EncoderVariant, MaskedLMNames
from .pipeline import entry_points

CONFIG_FIELDS = {
    **{name: ours for name, ours in CONFIG_FIELDS.items() if name != "classifier_dropout"},
    "classifier_dropout_prob": "classifier_dropout",
    "embedding_size": "embedding_size",
    "num_hidden_groups": "num_hidden_groups",
    "inner_group_num": "inner_group_num",
}
LAYER_MODULES = {
    "attention.query": "self_attn.q_proj",
    "attention.key": "self_attn.k_proj",
    "attention.value": "self_attn.v_proj",
    "attention.dense": "self_attn.o_proj",
    "attention.LayerNorm": "input_layernorm",
    "ffn": "mlp.up_proj",
    "ffn_output": "mlp.down_proj",
    "full_layer_layer_norm": "post_attention_layernorm",
}


def shared_layer_pairs(config) -> list[tuple[str, str]]:
    """Block j of group g <-> hf_tiny block g * inner_group_num + j."""
    inner = config.inner_group_num
    return [
        (f"encoder.albert_layer_groups.{group}.albert_layers.{j}", f"layers.{group * inner + j}")
        for group in range(config.num_hidden_groups)
        for j in range(inner)
    ]


ALBERT = EncoderVariant(
    model_type="albert",
    class_prefix="Albert",
    masked_lm=MaskedLMNames("predictions.dense", "predictions.LayerNorm", decoder="predictions.decoder",
                            bias="predictions.bias"),
    parts={"pooler": {"pooler": "pooler.dense"}, "next_sentence": {"sop_classifier.classifier": "next_sentence"}, **TASK_PARTS},
    class_parts=BERT.class_parts,
    fixed_config={"project_embeddings": True},
    config_fields=CONFIG_FIELDS,
    derived_config={"next_sentence_dropout": "classifier_dropout_prob"},
    layer_pairs=shared_layer_pairs,
    layer_modules=LAYER_MODULES,
    embedding_projection="encoder.embedding_hidden_mapping_in",
)


FAMILY = EncoderFamily(ALBERT, "hf_tiny_encoder (BERT-style encoder, ALBERT sharing)",
                       markers=("encoder.embedding_hidden_mapping_in.weight",))
convert, convert_back = entry_points(FAMILY)

"""RoBERTa (transformers `model_type: roberta`) <-> hf_tiny encoder: the BERT table with RoBERTa's names.

    python -m conversion [roberta] SRC DST              official RoBERTa folder -> hf_tiny folder
    python -m conversion [roberta] SRC DST --reverse    hf_tiny encoder folder (positions_from_padding) -> RoBERTa

What differs from BERT: positions numbered from pad_token_id + 1 and derived from the input ids
(`positions_from_padding`), the MLM head named `lm_head.*`, and the sequence-classification head
`classifier.dense` -> tanh -> `classifier.out_proj` on the first token, which is hf_tiny's sequence classifier with
its own pooler (`pre_classifier`, PEFT trains it as official's head) and one more dropout before the dense layer
(`dropout_before_pooler`).
"""

from __future__ import annotations

from .bert import CLASSIFICATION_HEAD, TASK_PARTS, EncoderFamily, EncoderVariant, MaskedLMNames, class_parts
from .pipeline import entry_points

ROBERTA = EncoderVariant(
    model_type="roberta",
    class_prefix="Roberta",
    masked_lm=MaskedLMNames("lm_head.dense", "lm_head.layer_norm", decoder="lm_head.decoder", bias="lm_head.bias"),
    parts={"pooler": {"pooler.dense": "pooler.dense"}, "classification_head": CLASSIFICATION_HEAD, **TASK_PARTS},
    class_parts=class_parts(base_pooler=True, sequence=("classification_head",)),
    fixed_config={"positions_from_padding": True, "dropout_before_pooler": True, "pre_classifier": True},
    layout_fields=("pre_classifier",),
)


FAMILY = EncoderFamily(ROBERTA, "hf_tiny_encoder (BERT-style encoder, RoBERTa positions)")
convert, convert_back = entry_points(FAMILY)

"""ELECTRA (transformers `model_type: electra`) <-> hf_tiny encoder: the BERT table with ELECTRA's names.

    python -m conversion [electra] SRC DST              official ELECTRA folder -> hf_tiny folder
    python -m conversion [electra] SRC DST --reverse    hf_tiny encoder folder -> official ELECTRA

What differs from BERT: factorized embeddings (`embedding_size`, projected to hidden_size by
`embeddings_project` -> hf_tiny `embed_projection`), no pooler in the base model, the generator
(`ElectraForMaskedLM`: dense to embedding_size, GELU, LayerNorm, tied decoder with its own bias), the
discriminator (`ElectraForPreTraining` -> `TinyEncoderForReplacedTokenDetection`), and the sequence classifier
dropout -> dense -> GELU -> dropout -> out_proj (hf_tiny's classifier's own pooler, `pre_classifier`, with
pooler_act="gelu" and dropout_before_pooler).
"""

from __future__ import annotations

from .bert import (
    CLASSIFICATION_HEAD, CONFIG_FIELDS, DISCRIMINATOR_CLASS, TASK_PARTS, EncoderFamily, EncoderVariant, MaskedLMNames,
    class_parts,
)
from .errors import ConversionError
from .pipeline import Plan, Source, entry_points

ELECTRA = EncoderVariant(
    model_type="electra",
    class_prefix="Electra",
    masked_lm=MaskedLMNames("generator_predictions.dense", "generator_predictions.LayerNorm", decoder="generator_lm_head"),
    parts={
        "discriminator": {
            "discriminator_predictions.dense": "discriminator.dense",
            "discriminator_predictions.dense_prediction": "discriminator.prediction",
        },
        "classification_head": CLASSIFICATION_HEAD,
        **TASK_PARTS,
    },
    class_parts=class_parts(base_pooler=False, pretraining=("discriminator",), sequence=("classification_head",)),
    fixed_config={"add_pooling_layer": False, "pooler_act": "gelu", "dropout_before_pooler": True,
                  "pre_classifier": True},
    layout_fields=("pre_classifier",),
    config_fields={**CONFIG_FIELDS, "embedding_size": "embedding_size"},
    embedding_projection="embeddings_project",
    class_overrides={"ForPreTraining": DISCRIMINATOR_CLASS},
)


class ElectraFamily(EncoderFamily):
    def plan(self, source: Source) -> Plan:
        plan = super().plan(source)
        if plan.our_class == "TinyEncoderForMaskedLM" and plan.config.hidden_act != "gelu":
            # the official generator head applies GELU whatever hidden_act says; hf_tiny's MLM head uses hidden_act
            raise ConversionError(
                f"{source.path}: ElectraForMaskedLM with hidden_act={plan.config.hidden_act!r} is not supported "
                "(its generator head always applies 'gelu')"
            )
        return plan


FAMILY = ElectraFamily(ELECTRA, "hf_tiny_encoder (BERT-style encoder, ELECTRA layout)")
convert, convert_back = entry_points(FAMILY)

"""Fine-tune the converted all-MiniLM-L6-v2 encoder for sentiment classification with transformers.Trainer.

    python examples/finetune_encoder.py                      # real weights: converts MiniLM first (~30 s)
    python examples/finetune_encoder.py --tiny --max-steps 10 # a tiny random model, seconds
    torchrun --nproc_per_node=2 examples/finetune_encoder.py --tiny   # DDP (gloo on CPU); add --fsdp native for FSDP2

Data: examples/data/sentiment.tsv, short labelled sentences shipped in the repo (the eval split uses predicates the
train split never shows). Prints the loss curve and the eval accuracy, saves OUTPUT_DIR/final with
save_pretrained and checks that AutoModelForSequenceClassification reloads it with identical logits.
"""

from __future__ import annotations

import argparse
import csv
from typing import Optional, Sequence

import torch

import finetune_common as common

LABELS = {0: "negative", 1: "positive"}
TASK = "sequence classification"


def load_sentiment(split: str) -> list[dict]:
    with open(common.DATA_DIR / "sentiment.tsv", newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    return [{"text": row["text"], "label": int(row["label"])} for row in rows if row["split"] == split]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return common.parse_args(
        argv, description=__doc__, name="finetune_encoder", learning_rate=5e-5, tiny_learning_rate=1e-3, batch_size=16
    )


def label_fields() -> dict:
    """The classifier's labels, for the config of the tiny model and for the head put on MiniLM."""
    return {"num_labels": len(LABELS), "id2label": LABELS, "label2id": {name: index for index, name in LABELS.items()}}


def tiny_model_and_tokenizer(args: argparse.Namespace):
    from hf_tiny import TinyEncoderConfig, TinyEncoderForSequenceClassification

    texts = [row["text"] for split in ("train", "eval") for row in load_sentiment(split)]
    tokenizer = common.word_tokenizer(
        texts,
        specials={"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]"},
        single_template="[CLS] $A [SEP]",
    )
    config = common.tiny_config(
        TinyEncoderConfig, tokenizer, args, max_position_embeddings=64,
        # 0.02 (BERT's init) is made for width 384+: at width 32 the [CLS] state would barely see the sentence
        initializer_range=0.2, **label_fields(),
    )
    return TinyEncoderForSequenceClassification(config), tokenizer


def real_model_and_tokenizer(args: argparse.Namespace):
    from conversion import bert
    from transformers import AutoModelForSequenceClassification

    return common.load_converted(
        AutoModelForSequenceClassification, args, "minilm", bert.convert, common.minilm_source(),
        **label_fields(), **common.dropout_overrides(args.dropout),
    )


def encode(rows: list[dict], tokenizer) -> list[dict]:
    encoded = tokenizer([row["text"] for row in rows], truncation=True, max_length=64)
    return [{"input_ids": ids, "labels": row["label"]} for ids, row in zip(encoded["input_ids"], rows)]


class ClassificationCollator:
    """Right-pads input_ids and builds attention_mask; `label` (the datasets habit) is accepted for `labels`."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    @staticmethod
    def rename_label(feature: dict) -> dict:
        if "label" in feature and "labels" not in feature:
            feature = {**feature, "labels": feature["label"]}
            del feature["label"]
        return feature

    def __call__(self, features: Sequence[dict]) -> dict:
        features = [self.rename_label(feature) for feature in features]
        common.require_fields(features, ("input_ids", "labels"), task=TASK)
        ids = [feature["input_ids"] for feature in features]
        return {
            "input_ids": common.pad_right(ids, self.pad_token_id),
            "attention_mask": common.attention_mask_for(ids),
            "labels": torch.tensor([int(feature["labels"]) for feature in features]),
        }


def accuracy(eval_prediction) -> dict:
    logits, labels = eval_prediction.predictions, eval_prediction.label_ids
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def make_trainer(args: argparse.Namespace, *, train_rows: Optional[list[dict]] = None):
    """The Trainer of this example. train_rows: replace the encoded training set (tests pass odd data here)."""
    from transformers import Trainer, set_seed

    training_args = common.training_arguments(args)
    set_seed(args.seed)  # the classifier head (and the whole tiny model) is initialized from this seed
    model, tokenizer = (tiny_model_and_tokenizer if args.tiny else real_model_and_tokenizer)(args)
    train = train_rows if train_rows is not None else encode(load_sentiment("train"), tokenizer)
    trainer = Trainer(
        model=common.distribute(model, args),
        args=training_args,
        train_dataset=train,
        eval_dataset=encode(load_sentiment("eval"), tokenizer),
        data_collator=ClassificationCollator(tokenizer.pad_token_id),
        compute_metrics=accuracy,
        processing_class=tokenizer,  # saved beside the model by trainer.save_model
    )
    return trainer


def main(argv: Optional[Sequence[str]] = None) -> dict:
    from transformers import AutoModelForSequenceClassification

    args = parse_args(argv)
    trainer = make_trainer(args)
    what = f"eval accuracy ({len(trainer.eval_dataset)} held-out sentences)"
    return common.train_evaluate_save(
        args, trainer, report=common.metric_report(what, "eval_accuracy"), auto_class=AutoModelForSequenceClassification
    )


if __name__ == "__main__":
    main()

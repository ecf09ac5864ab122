"""Seq2SeqTrainer fine-tunes an hf_tiny seq2seq model on a copy task generated here; the loss goes down, and on the
same batch it equals the loss of the official BART twin (converted with the production converters) before and
after training."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration, Seq2SeqTrainer, Seq2SeqTrainingArguments

from conversion import bart
from hf_tiny import TinySeq2SeqForConditionalGeneration

PAD, BOS, EOS = 1, 0, 2
VOCAB = 16
FIRST_WORD = 3

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def copy_task(count: int, seed: int) -> list[dict]:
    """Source: 3-8 random word ids; target: the same ids followed by </s>."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        words = [rng.randrange(FIRST_WORD, VOCAB) for _ in range(rng.randint(3, 8))]
        examples.append({"input_ids": words, "labels": words + [EOS]})
    return examples


def collate(examples: list[dict]) -> dict:
    """Right padding: inputs with <pad> (mask 0), labels with -100 (ignored by the loss)."""
    width = max(len(e["input_ids"]) for e in examples)
    label_width = max(len(e["labels"]) for e in examples)
    input_ids = torch.full((len(examples), width), PAD)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), label_width), -100)
    for row, example in enumerate(examples):
        input_ids[row, : len(example["input_ids"])] = torch.tensor(example["input_ids"])
        attention_mask[row, : len(example["input_ids"])] = 1
        labels[row, : len(example["labels"])] = torch.tensor(example["labels"])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def official_loss(path, batch) -> float:
    official = BartForConditionalGeneration.from_pretrained(path).eval()
    with torch.no_grad():
        return float(official(**batch).loss)


def our_loss(model, batch) -> float:
    model.eval()
    with torch.no_grad():
        return float(model(**batch).loss)


@pytest.mark.slow
def test_seq2seq_trainer_learns_copy_task_and_matches_official_loss(tmp_path):
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=32, dropout=0.0,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=EOS, forced_eos_token_id=EOS,
    )
    BartForConditionalGeneration(config).save_pretrained(tmp_path / "official")
    bart.convert(tmp_path / "official", tmp_path / "ours")
    model = TinySeq2SeqForConditionalGeneration.from_pretrained(tmp_path / "ours")

    batch = collate(copy_task(32, seed=123))  # held-out batch, padded on both sides
    assert (batch["labels"] == -100).any() and (batch["attention_mask"] == 0).any()
    before = our_loss(model, batch)
    before_official = official_loss(tmp_path / "official", batch)
    print(f"loss before training: ours {before:.6f}, official {before_official:.6f}")
    assert abs(before - before_official) <= 1e-5

    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=16, gradient_accumulation_steps=2, max_steps=50,
        learning_rate=1e-2, warmup_steps=0, weight_decay=0.0, logging_steps=10, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=copy_task(1600, seed=7), data_collator=collate)
    result = trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 5 and logged[-1] < logged[0]

    after = our_loss(model, batch)
    assert after < 0.25 * before, (before, after)
    assert result.training_loss < before

    # and it copies: greedy decoding of held-out sources gives the source followed by </s>
    held_out = copy_task(16, seed=99)
    inputs = collate(held_out)
    generated = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=10,
                               do_sample=False)
    copied = sum(row[1 : 1 + len(e["labels"])].tolist() == e["labels"] for row, e in zip(generated, held_out, strict=True))
    print(f"losses logged by Trainer: {logged}; held-out loss after: {after:.4f}; copied {copied}/16")
    assert copied >= 12, f"{copied}/16 held-out sequences copied exactly"

    # the trained weights, converted back to the official format, give the official model the same loss
    model.save_pretrained(tmp_path / "trained")
    bart.convert_back(tmp_path / "trained", tmp_path / "trained_official")
    after_official = official_loss(tmp_path / "trained_official", batch)
    print(f"loss after training: ours {after:.6f}, official twin {after_official:.6f}")
    assert abs(after - after_official) <= 1e-5

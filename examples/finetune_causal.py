"""Fine-tune the converted SmolLM2-135M-Instruct causal LM on a small instruction set with transformers.Trainer.

    python examples/finetune_causal.py --max-steps 30          # real weights: converts the GGUF first (~1 min)
    python examples/finetune_causal.py --tiny --max-steps 10    # a tiny random model, seconds
    torchrun --nproc_per_node=2 examples/finetune_causal.py --tiny --fsdp native   # FSDP2 (without --fsdp: DDP)

Data: examples/data/instructions.jsonl, short instruction/response pairs shipped in the repo. Each example is the
chat-formatted prompt followed by the response and EOS; the loss covers the response tokens only (the prompt is
labelled -100), so sequences carry different numbers of target tokens. The model's loss honours Trainer's
num_items_in_batch, which keeps gradient accumulation and multi-process training equal to one big batch.
Prints the loss curve, the held-out perplexity and next-token accuracy on response tokens, a few generations, saves
OUTPUT_DIR/final and checks that AutoModelForCausalLM reloads it with identical logits.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

import torch

import finetune_common as common

TASK = "causal LM fine-tuning"


def load_instructions(split: str) -> list[dict]:
    with open(common.DATA_DIR / "instructions.jsonl") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [row for row in rows if row["split"] == split]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return common.parse_args(
        argv, description=__doc__, name="finetune_causal", learning_rate=2e-5, tiny_learning_rate=3e-3, batch_size=4
    )


def prompt_text(tokenizer, instruction: str) -> str:
    """The instruct model's own chat template when the tokenizer has one; a plain format otherwise (--tiny)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": instruction}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"question : {instruction} answer :"


def tiny_model_and_tokenizer(args: argparse.Namespace):
    from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM

    rows = load_instructions("train") + load_instructions("eval")
    texts = [f"question : {row['instruction']} answer : {row['response']}" for row in rows]
    tokenizer = common.word_tokenizer(
        texts, specials={"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    )
    config = common.tiny_config(
        TinyCausalConfig, tokenizer, args, dropout_fields=("attention_dropout",),
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, tie_word_embeddings=True,
    )
    return TinyCausalForCausalLM(config), tokenizer


def real_model_and_tokenizer(args: argparse.Namespace):
    from conversion import llama
    from transformers import AutoModelForCausalLM

    return common.load_converted(
        AutoModelForCausalLM, args, "smollm2", llama.convert, common.smollm2_source(),
        dtype=torch.float32, **common.dropout_overrides(args.dropout, ("attention_dropout",)),
    )


def encode(rows: list[dict], tokenizer) -> list[dict]:
    """input_ids = prompt + response + EOS; labels = -100 over the prompt, the token ids over response + EOS."""
    examples = []
    for row in rows:
        prompt = tokenizer(prompt_text(tokenizer, row["instruction"]), add_special_tokens=False)["input_ids"]
        response = tokenizer(" " + row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append({"input_ids": prompt + response, "labels": [common.IGNORE_INDEX] * len(prompt) + response})
    return examples


def keep_argmax(logits, labels):
    """Evaluation keeps predicted ids, not [batch, length, vocab] logits (49152 columns for SmolLM2)."""
    return logits.argmax(-1)


def response_token_accuracy(eval_prediction) -> dict:
    predictions, labels = eval_prediction.predictions, eval_prediction.label_ids
    predicted, target = predictions[:, :-1], labels[:, 1:]  # logits at t predict token t + 1
    scored = target != common.IGNORE_INDEX
    return {"response_token_accuracy": float((predicted[scored] == target[scored]).mean())}


def make_trainer(args: argparse.Namespace, *, train_rows: Optional[list[dict]] = None):
    """The Trainer of this example. train_rows: replace the encoded training set (tests pass odd data here)."""
    from transformers import Trainer, set_seed

    training_args = common.training_arguments(args)
    set_seed(args.seed)
    model, tokenizer = (tiny_model_and_tokenizer if args.tiny else real_model_and_tokenizer)(args)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Trainer(
        model=common.distribute(model, args),
        args=training_args,
        train_dataset=train_rows if train_rows is not None else encode(load_instructions("train"), tokenizer),
        eval_dataset=encode(load_instructions("eval"), tokenizer),
        data_collator=common.TokenLabelCollator(pad_token_id, task=TASK),
        compute_metrics=response_token_accuracy,
        preprocess_logits_for_metrics=keep_argmax,
        processing_class=tokenizer,
    )


@torch.no_grad()
def sample_generations(model, tokenizer, rows: list[dict], max_new_tokens: int = 16) -> list[tuple[str, str, str]]:
    model.eval()
    device = next(model.parameters()).device
    results = []
    for row in rows:
        prompt = tokenizer(prompt_text(tokenizer, row["instruction"]), add_special_tokens=False, return_tensors="pt")
        output = model.generate(
            **{k: v.to(device) for k, v in prompt.items()},
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
        answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        results.append((row["instruction"], row["response"], answer))
    return results


def report(trainer, before: Optional[dict], after: dict) -> dict:
    """Held-out loss, perplexity and response accuracy before -> after training, and a few generations."""
    for when, values in (("before", before), ("after", after)):
        if values is not None:
            common.say(trainer, f"held-out ({len(trainer.eval_dataset)} instructions) {when} training: loss "
                       f"{values['eval_loss']:.4f}, perplexity {common.perplexity(values['eval_loss']):.2f}, "
                       f"response next-token accuracy {values['eval_response_token_accuracy']:.3f}")
    # every process generates: the forwards of a sharded (--fsdp) model are collective
    model = trainer.accelerator.unwrap_model(trainer.model)
    generations = sample_generations(model, trainer.processing_class, load_instructions("eval")[:3])
    for instruction, reference, answer in generations:
        common.say(trainer, f"  Q: {instruction}\n     reference: {reference}\n     model:     {answer}")
    return {
        "perplexity_before": None if before is None else common.perplexity(before["eval_loss"]),
        "perplexity_after": common.perplexity(after["eval_loss"]),
        "generations": generations,
    }


def main(argv: Optional[Sequence[str]] = None) -> dict:
    from transformers import AutoModelForCausalLM

    args = parse_args(argv)
    trainer = make_trainer(args)
    return common.train_evaluate_save(args, trainer, report=report, auto_class=AutoModelForCausalLM, reload_size=4)


if __name__ == "__main__":
    main()

"""`python -m benchmarks.mtp_speculative [--depth 1] [--steps 300]`: Multi-Token Prediction self-speculative
decoding, measured: a small causal LM with D MTP modules is trained under transformers' Trainer (next-token loss
+ lambda x MTP loss) on synthetic text with mostly predictable continuations, then greedy decoding runs plainly
(generate()) and with the MTP modules drafting (generate(use_mtp=True)) on the same prompts: the tokens (must be
identical), the acceptance rate of the drafts, the tokens per main-model forward, and tokens/s of both (batch 1,
fp32, CPU, median of --repeats). Writes mtp-speculative-<device>-<date>.md.

The synthetic text is a Markov chain over --vocab tokens in which every token has one successor with probability
--p-dominant (else a uniformly random token): a trained model's greedy continuation follows the dominant chain,
which depth k can learn to predict k + 1 tokens ahead.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

from .report import write_result

RESULTS_DIR = Path(__file__).parent / "results"


def markov_rows(vocab: int, rows: int, length: int, p_dominant: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=generator)
    ids = torch.empty(rows, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (rows,), generator=generator)
    for position in range(1, length):
        follow = torch.rand(rows, generator=generator) < p_dominant
        random = torch.randint(0, vocab, (rows,), generator=generator)
        ids[:, position] = torch.where(follow, successor[ids[:, position - 1]], random)
    return ids


def train(args) -> "torch.nn.Module":
    from transformers import Trainer, TrainingArguments

    from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM

    torch.manual_seed(args.seed)
    config = TinyCausalConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, max_position_embeddings=1024,
        num_nextn_predict_layers=args.depth, mtp_loss_weight=args.mtp_weight, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )
    model = TinyCausalForCausalLM(config)
    ids = markov_rows(args.vocab, args.rows, args.length, args.p_dominant, args.seed)
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    training = TrainingArguments(
        output_dir=str(args.work_dir), per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=args.lr, warmup_steps=args.steps // 10, logging_steps=max(1, args.steps // 10),
        save_strategy="no", report_to=[], use_cpu=True, seed=args.seed, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=dataset)
    result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return model.eval(), losses, result.metrics["train_runtime"]


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=1, help="MTP modules (tokens drafted per round)")
    parser.add_argument("--mtp-weight", type=float, default=0.3, help="lambda, the MTP loss weight (DeepSeek-V3: 0.3)")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--p-dominant", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/hf_tiny_mtp_benchmark"))
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    model, losses, train_seconds = train(args)
    prompts = markov_rows(args.vocab, args.prompts, 8, args.p_dominant, args.seed + 1)
    settings = dict(max_new_tokens=args.new_tokens, pad_token_id=0, eos_token_id=None)
    plain_s = mtp_s = 0.0
    drafted = accepted = rounds = 0
    identical = True
    for prompt in prompts:
        prompt = prompt[None]
        plain_time, plain = timed(lambda: model.generate(prompt, do_sample=False, **settings), args.repeats)
        mtp_time, drafted_out = timed(lambda: model.generate(prompt, use_mtp=True, **settings), args.repeats)
        identical &= torch.equal(plain, drafted_out)
        plain_s += plain_time
        mtp_s += mtp_time
        drafted += model.mtp_stats["drafted"]
        accepted += model.mtp_stats["accepted"]
        rounds += model.mtp_stats["rounds"]
    tokens = args.prompts * args.new_tokens
    parameters = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("mtp."))
    mtp_parameters = sum(p.numel() for name, p in model.named_parameters() if name.startswith("mtp."))
    lines = [
        f"# MTP self-speculative decoding ({datetime.date.today()}, cpu, {torch.get_num_threads()} threads)",
        "",
        "`python -m benchmarks.mtp_speculative " + " ".join(sys.argv[1:] if argv is None else argv) + "`"
        f" (depth {args.depth}, lambda {args.mtp_weight}; model {parameters / 1e6:.2f} M parameters + "
        f"{mtp_parameters / 1e6:.2f} M in MTP modules, hidden {args.hidden}, {args.layers} layers; trained "
        f"{args.steps} steps under Trainer in {train_seconds:.0f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}).",
        "",
        "| | value |",
        "|---|---|",
        f"| tokens identical to plain greedy | {identical} |",
        f"| drafts accepted | {accepted} / {drafted} = {accepted / max(drafted, 1):.3f} |",
        f"| tokens per main-model forward (after the prompt) | {(tokens - args.prompts) / max(rounds, 1):.2f} |",
        f"| plain greedy generate() | {tokens / plain_s:.1f} tokens/s |",
        f"| generate(use_mtp=True) | {tokens / mtp_s:.1f} tokens/s |",
        f"| speed-up | {plain_s / mtp_s:.2f}x |",
    ]
    output = args.output or RESULTS_DIR / f"mtp-speculative-cpu-{datetime.date.today()}-depth{args.depth}.md"
    return write_result(lines, output)


if __name__ == "__main__":
    main()

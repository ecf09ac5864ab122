"""Captured decoding of a Mixture-of-Experts model: generate() with a static cache and generate's auto-compile, official
Mixtral beside hf_tiny's converted twin, and hf_tiny with the routed loop kept inside the compiled step.
Each contender compiles and runs its own step after a dynamo reset (one warm-up call, which compiles), in turn.

hf_tiny's MoE layers take the routed loop (each expert on the tokens that chose it) outside compilation; inside a
compiled step of at most moe.COMPILED_DENSE_MAX_TOKENS tokens every expert runs on every token, in fixed shapes, so
the step compiles as one graph (fullgraph=True) that a CUDA graph can replay. Official transformers gets fixed shapes
from its stacked expert weights (grouped_mm; batched_mm for decoding on a GPU). Contenders:
- official: official Mixtral (its default experts implementation);
- hf_tiny: the default (fixed shapes in the compiled step);
- hf_tiny_routed: moe.COMPILED_DENSE_MAX_TOKENS = 0, the routed loop in the compiled step too, which breaks the
  graph at every MoE layer (generate's default fullgraph=False).

CUDA: inductor, mode "reduce-overhead" (transformers' default CompileConfig), bf16. CPU: inductor without CUDA graphs
(CompileConfig._compile_all_devices: generate does not compile on a CPU by itself), fp32.

    python -m benchmarks.moe_decode [--device cpu] [--batches 1,8,32] [--new-tokens 32] [--out FILE.md]

The page goes to stdout (and to --out with its rows as .json beside it), each row's progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.machine import cpu_model, git_revision
from benchmarks.measure import time_interleaved
from benchmarks.models import cache_dir
from benchmarks.workloads import Shape, build_generate

# a random Mixtral: 8 experts, top-2, 4 layers of width 512 (experts 1024 wide): 4 x 8 x 3 x 512 x 1024 expert weights
MIXTRAL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
               rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
PROMPT = 16


def folders(refresh: bool = False) -> tuple[Path, Path]:
    """(official folder, hf_tiny folder) of the random Mixtral (seed 0, std 0.02), made once in the cache folder."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from conversion import llama

    root = cache_dir() / "mixtral-decode"
    official, ours = root / "official", root / "hf_tiny"
    if refresh or not (ours / "config.json").is_file():
        torch.manual_seed(0)
        MixtralForCausalLM(MixtralConfig(**MIXTRAL, initializer_range=0.02)).save_pretrained(official)
        llama.convert(official, ours, force=True)
    return official, ours


def compile_config(device: torch.device):
    from transformers import CompileConfig

    if device.type == "cuda":
        return CompileConfig(mode="reduce-overhead")
    config = CompileConfig()
    config._compile_all_devices = True
    return config


def routed_in_the_graph(fn):
    """fn with the routed loop inside the compiled step (dynamo guards on the constant: its own graphs)."""
    from hf_tiny import moe

    def call():
        default, moe.COMPILED_DENSE_MAX_TOKENS = moe.COMPILED_DENSE_MAX_TOKENS, 0
        try:
            return fn()
        finally:
            moe.COMPILED_DENSE_MAX_TOKENS = default

    return call


def measure(device: torch.device, batches: list[int], new_tokens: int, repeats: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    import hf_tiny  # noqa: F401  (registers the Auto classes)

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    official_dir, ours_dir = folders()
    load = lambda folder: AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()  # noqa: E731
    models = {"official": load(official_dir), "hf_tiny": load(ours_dir), "hf_tiny_routed": load(ours_dir)}
    rows = []
    for batch in batches:
        shape = Shape(batch=batch, seq=PROMPT, new_tokens=new_tokens)
        start, timings = time.perf_counter(), {}
        for name, model in models.items():  # one after the other: each compiles its own step, from a clean slate
            torch._dynamo.reset()
            call = build_generate(model, shape, device, static_cache=True, compile_config=compile_config(device))
            call = routed_in_the_graph(call) if name == "hf_tiny_routed" else call
            timings.update(time_interleaved({name: call}, device=device, warmup=1, repeats=repeats))
        tokens = {name: timing.last_output[:, PROMPT:] for name, timing in timings.items()}
        rows.append({
            "batch": batch, "new_tokens": new_tokens, "wall_s": round(time.perf_counter() - start, 1),
            **{f"{name}_tokens_per_s": batch * new_tokens / timing.median for name, timing in timings.items()},
            **{f"{name}_spread_s": timing.spread for name, timing in timings.items()},
            "tokens_equal_official": {name: float((tokens[name] == tokens["official"]).float().mean())
                                      for name in ("hf_tiny", "hf_tiny_routed")},
        })
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress; the page alone goes to stdout
    return rows


def report(rows: list[dict], device: torch.device, command: str) -> str:
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_model()}, {torch.get_num_threads()} threads"
    lines = [
        f"# Captured decoding of a Mixture-of-Experts model — {name} — {time.strftime('%Y-%m-%d')}",
        "",
        f"- command: `{command}` (hf_tiny commit {git_revision()})",
        f"- torch {torch.__version__}, transformers {transformers.__version__}; random Mixtral ({json.dumps(MIXTRAL)}),"
        f" prompt {PROMPT} tokens, greedy; generate's auto-compile with a static cache; median of the timed calls",
        "- official: its default experts implementation; hf_tiny: fixed shapes in the compiled step; hf_tiny routed: "
        "the routed loop in the compiled step too (graph breaks at every MoE layer)",
        "",
        "| batch x new tokens | official tok/s | hf_tiny tok/s | hf_tiny routed tok/s | hf_tiny / official | hf_tiny / routed | greedy tokens = official's (hf_tiny, routed) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        official, ours, routed = (row[f"{n}_tokens_per_s"] for n in ("official", "hf_tiny", "hf_tiny_routed"))
        same = row["tokens_equal_official"]
        lines.append(f"| {row['batch']} x {row['new_tokens']} | {official:,.1f} | {ours:,.1f} | {routed:,.1f} | "
                     f"{ours / official:.2f}x | {ours / routed:.2f}x | {same['hf_tiny']:.0%}, {same['hf_tiny_routed']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the markdown table here (and its rows as .json beside it)")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 for b in batches) or args.new_tokens < 2 or args.repeats < 1:
        parser.error(f"--batches must be positive, --new-tokens >= 2, --repeats >= 1; got {args.batches!r}, "
                     f"{args.new_tokens}, {args.repeats}")
    device = torch.device(args.device)
    rows = measure(device, batches, args.new_tokens, args.repeats)
    command = "python -m benchmarks.moe_decode " + " ".join(argv if argv is not None else sys.argv[1:])
    page = report(rows, device, command.strip())
    print(page)
    if args.out:
        args.out.write_text(page)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

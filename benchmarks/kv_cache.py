"""`python -m benchmarks.kv_cache [--tokens 256] [--dtype bfloat16]`: KV-cache bytes per token and per layer for
multi-head (MHA), grouped-query (GQA), multi-query (MQA) and Multi-head Latent Attention (MLA) at one model size,
measured from the cache objects a forward pass fills (the bytes of every tensor the cache layers hold, divided
by tokens and layers), beside what the shapes say. Writes kv-cache-<date>.md.

The size is DeepSeek-V2-Lite's attention: hidden 2048, 16 query heads of 128 (MLA: 128 + 64 rotary for queries
and keys, 128 for values, kv_lora_rank 512).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

from .report import write_result

RESULTS_DIR = Path(__file__).parent / "results"
HIDDEN, HEADS, HEAD_DIM = 2048, 16, 128
VARIANTS = {
    "MHA (16 KV heads)": dict(num_key_value_heads=16, head_dim=HEAD_DIM),
    "GQA (4 KV heads)": dict(num_key_value_heads=4, head_dim=HEAD_DIM),
    "MQA (1 KV head)": dict(num_key_value_heads=1, head_dim=HEAD_DIM),
    "MLA (kv_lora_rank 512, rope 64)": dict(kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                            v_head_dim=128),
}


def expected_bytes_per_token(fields: dict, element_size: int) -> int:
    """What the cache must hold per token and layer, from the shapes: 2 x KV heads x head_dim (keys and values),
    or MLA's latent plus its shared rotary key."""
    if "kv_lora_rank" in fields:
        return (fields["kv_lora_rank"] + fields["qk_rope_head_dim"]) * element_size
    return 2 * fields["num_key_value_heads"] * fields["head_dim"] * element_size


def measure(fields: dict, tokens: int, layers: int, dtype: torch.dtype) -> float:
    from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM

    config = TinyCausalConfig(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=HEADS, max_position_embeddings=4096, **fields,
    )
    model = TinyCausalForCausalLM(config).to(dtype).eval()
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    held = sum(
        tensor.numel() * tensor.element_size()
        for layer in cache.layers for tensor in (layer.keys, layer.values) if isinstance(tensor, torch.Tensor)
    )
    return held / tokens / layers


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    element = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for name, fields in VARIANTS.items():
        measured = measure(fields, args.tokens, args.layers, dtype)
        rows.append((name, measured, expected_bytes_per_token(fields, element)))
    mha = rows[0][1]
    lines = [
        f"# KV-cache bytes per token and layer ({datetime.date.today()})",
        "",
        f"Measured from the cache after one forward of {args.tokens} tokens through {args.layers} layers "
        f"({args.dtype}; hidden {HIDDEN}, {HEADS} query heads): `python -m benchmarks.kv_cache --tokens {args.tokens} "
        f"--layers {args.layers} --dtype {args.dtype}`.",
        "",
        "| attention | bytes / token / layer (measured) | from the shapes | vs MHA |",
        "|---|---|---|---|",
    ]
    for name, measured, expected in rows:
        lines.append(f"| {name} | {measured:,.0f} | {expected:,} | {measured / mha:.3f} |")
    output = args.output or RESULTS_DIR / f"kv-cache-{datetime.date.today()}.md"
    return write_result(lines, output)


if __name__ == "__main__":
    main()

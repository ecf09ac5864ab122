"""Would fused projections win? q/k/v as one [q+k+v, hidden] matrix and gate/up as one [2 * inter, hidden] matrix,
against the separate products a Llama block runs today, at a model's own shapes.

    python -m benchmarks.fusion [--model smollm2] [--tokens 1,8,1024] [--threads N]

Each layer gets its own weights (a model's depth of them, cycled), so decode-sized products read their weights
from memory as in a real step instead of from cache. Prints, per token count, the time of one pass over every
layer's projections separately and fused (the output split back into q, k, v / gate, up, as a model would), and
the ratio. This is the measurement behind issue 17's decision about fused projections.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.nn.functional as F

SHAPES = {
    # hidden, q width, k/v width, intermediate, layers
    "smollm2": (576, 576, 192, 1536, 30),
    "minilm": (384, 384, 384, 1536, 6),
}


def micro_arguments(doc: str, shapes: dict, sizes: tuple, repeats: int, argv=None) -> argparse.Namespace:
    """The command line the micro benchmarks share (this one and few_rows): --model of `shapes`, the sizes to
    measure (`sizes`: flag, default, help), --threads (set here) and --repeats."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(shapes), default="smollm2")
    flag, default, help_text = sizes
    parser.add_argument(flag, default=default, help=help_text)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=repeats)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def best_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(model: str, tokens: int, repeats: int) -> dict:
    hidden, q_width, kv_width, inter, layers = SHAPES[model]
    generator = torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator)

    separate_qkv = [(weight(q_width, hidden), weight(kv_width, hidden), weight(kv_width, hidden)) for _ in range(layers)]
    fused_qkv = [torch.cat(ws) for ws in separate_qkv]
    separate_glu = [(weight(inter, hidden), weight(inter, hidden)) for _ in range(layers)]
    fused_glu = [torch.cat(ws) for ws in separate_glu]
    x = torch.randn(tokens, hidden, generator=generator)
    splits = [q_width, kv_width, kv_width]
    with torch.inference_mode():
        rows = {
            "qkv separate": best_time(lambda: [[F.linear(x, w) for w in ws] for ws in separate_qkv], repeats),
            "qkv fused": best_time(lambda: [F.linear(x, w).split(splits, -1) for w in fused_qkv], repeats),
            "gate/up separate": best_time(lambda: [[F.linear(x, w) for w in ws] for ws in separate_glu], repeats),
            "gate/up fused": best_time(lambda: [F.linear(x, w).chunk(2, -1) for w in fused_glu], repeats),
        }
    return rows


def main(argv=None) -> None:
    args = micro_arguments(__doc__, SHAPES, ("--tokens", "1,8,1024", "comma-separated token counts (batch x new tokens)"),
                           repeats=7, argv=argv)
    print(f"# Fused vs separate projections: {args.model}, fp32, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {datetime.date.today()}")
    print("\n| tokens | qkv separate | qkv fused | fused / separate | gate/up separate | gate/up fused | fused / separate |")
    print("|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        r = measure(args.model, tokens, args.repeats)
        print(
            f"| {tokens} | {r['qkv separate'] * 1e3:.2f} ms | {r['qkv fused'] * 1e3:.2f} ms | "
            f"{r['qkv fused'] / r['qkv separate']:.2f} | {r['gate/up separate'] * 1e3:.2f} ms | "
            f"{r['gate/up fused'] * 1e3:.2f} ms | {r['gate/up fused'] / r['gate/up separate']:.2f} |"
        )


if __name__ == "__main__":
    main()

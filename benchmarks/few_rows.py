"""F.linear against hf_tiny's weight-first product (hf_tiny/runtime.py) for the few rows of a decoding step, at a
model's own projection shapes.

    python -m benchmarks.few_rows [--model smollm2] [--rows 1,2,4,8,16,32,64,128,256] [--threads N]

Each projection gets a model's depth of distinct weights (the LM head one), cycled, so the products read their
weights from memory as in a real step instead of from cache. Prints, per shape and row count, the rate at which
each side reads the weights (GB/s, best of --repeats) and the ratio, the largest difference of each side from an
fp64 product, and which of the two hf_tiny's Linear takes there. Both are measured everywhere, also where
hf_tiny keeps F.linear, to show where they meet: this is the measurement behind runtime.py's thresholds.
"""

from __future__ import annotations

import datetime

import torch
import torch.nn.functional as F

from hf_tiny.runtime import few_rows_linear, weight_first

from .fusion import best_time, micro_arguments
from .machine import cpu_model

SHAPES = {
    # name: (out_features, in_features, how many in the model)
    "smollm2": {
        "q / o": (576, 576, 60),
        "k / v": (192, 576, 60),
        "gate / up": (1536, 576, 60),
        "down": (576, 1536, 30),
        "lm_head": (49152, 576, 1),
    },
}


def measure(out_features: int, in_features: int, count: int, rows: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=generator) * in_features**-0.5 for _ in range(count)]
    x = torch.randn(rows, in_features, generator=generator)
    with torch.inference_mode():
        official = best_time(lambda: [F.linear(x, w) for w in weights], repeats)
        ours = best_time(lambda: [few_rows_linear(x, w, None, rows) for w in weights], repeats)
        exact = F.linear(x.double(), weights[0].double())
        error_official = (F.linear(x, weights[0]).double() - exact).abs().max().item()
        error_ours = (few_rows_linear(x, weights[0], None, rows).double() - exact).abs().max().item()
    gigabytes = count * out_features * in_features * 4 / 1e9
    return dict(
        official=gigabytes / official, ours=gigabytes / ours, speedup=official / ours,
        error_official=error_official, error_ours=error_ours,
    )


def main(argv=None) -> None:
    args = micro_arguments(__doc__, SHAPES, ("--rows", "1,2,4,8,16,32,64,128,256", "comma-separated row counts"),
                           repeats=5, argv=argv)
    print(f"# F.linear vs the weight-first product for few rows: {args.model}, fp32, {cpu_model()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {datetime.date.today()}")
    print("\nWeights read per second (GB/s); the last column says which product hf_tiny's Linear takes "
          "(hf_tiny/runtime.py). Error: max |result - fp64 product| on the first weight.\n")
    print("| projection | shape | rows | F.linear | weight-first | speed-up | error F.linear | error weight-first | "
          "hf_tiny takes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (out_features, in_features, count) in SHAPES[args.model].items():
        for rows in (int(r) for r in args.rows.split(",")):
            r = measure(out_features, in_features, count, rows, args.repeats)
            print(
                f"| {name} | {out_features}×{in_features} | {rows} | {r['official']:.1f} | {r['ours']:.1f} | "
                f"{r['speedup']:.2f}× | {r['error_official']:.1e} | {r['error_ours']:.1e} | "
                f"{'weight-first' if weight_first(out_features, rows) else 'F.linear'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

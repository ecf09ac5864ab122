"""`python -m benchmarks.flash_kernel [--out DIR] [--quick]` (CUDA): our Triton FlashAttention kernel against
PyTorch SDPA's flash and cuDNN kernels (and flash-attn when installed), bf16, forward and forward+backward, causal
and not, sequence 512..16k at 16k tokens per batch, head_dim 64 and 128 (hidden 2048).

FLOPs: forward 4·B·H·S²·D (Q·Kᵀ and P·V), halved when causal; forward+backward 3.5× the forward (the backward's
five matrix products, FlashAttention 2's convention). TFLOP/s from the median time of triton.testing.do_bench;
"of peak" divides by a bf16 GEMM (8192³) measured in the same run. Writes
flash-kernel-<device>-<date>.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TOKENS = 16384
HIDDEN = 2048
# forward tile configurations tried for our kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages)
FORWARD_CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)]


def gemm_tflops(n: int = 8192) -> float:
    from triton.testing import do_bench

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def attention_flops(batch: int, heads: int, seq: int, dim: int, causal: bool, backward: bool) -> float:
    forward = 4 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    return forward * (3.5 if backward else 1.0)


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal).transpose(1, 2)

    return run


def implementations(blocks=None) -> dict:
    from torch.nn.attention import SDPBackend

    from hf_tiny import flash_triton

    def ours(q, k, v, causal):
        batch, seq, heads, dim = q.shape
        cu = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * seq
        if blocks is not None:  # forward only, a given tile configuration
            return flash_triton.flash_forward(q.view(-1, heads, dim), k.view(-1, heads, dim), v.view(-1, heads, dim),
                                              cu, cu, seq, scale=dim**-0.5, causal=causal, blocks=blocks)[0]
        return flash_triton.flash_attn_varlen(q.view(-1, heads, dim), k.view(-1, heads, dim), v.view(-1, heads, dim),
                                              cu, cu, seq, seq, causal=causal).view(q.shape)

    impls = {"hf_tiny_flash (Triton)": ours, "SDPA flash": _sdpa(SDPBackend.FLASH_ATTENTION),
             "SDPA cuDNN": _sdpa(SDPBackend.CUDNN_ATTENTION)}
    try:
        from flash_attn import flash_attn_func

        impls["flash-attn"] = lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)
    except ImportError:
        pass
    return impls


def measure(fn, q, k, v, causal: bool, backward: bool) -> float:
    """Median milliseconds of one call (forward, or forward + backward)."""
    from triton.testing import do_bench

    if not backward:
        with torch.no_grad():
            return do_bench(lambda: fn(q, k, v, causal), warmup=25, rep=100)
    grad = torch.randn_like(q)

    def step():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v, causal).backward(grad)

    return do_bench(step, warmup=25, rep=100)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.flash_kernel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--quick", action="store_true", help="sequences 512 and 2048 only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.manual_seed(0)
    peak = gemm_tflops()
    device_name = torch.cuda.get_device_name()
    rows, config_rows = [], []
    seqs = [512, 2048] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    for dim in (64, 128):
        heads = HIDDEN // dim
        for seq in seqs:
            batch = max(1, TOKENS // seq)
            q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            for causal in (False, True):
                # our forward with each tile configuration; the default is one of them
                for blocks in FORWARD_CONFIGS:
                    try:
                        ms = measure(implementations(blocks)["hf_tiny_flash (Triton)"], q, k, v, causal, False)
                        config_rows.append(dict(dim=dim, seq=seq, causal=causal, blocks=blocks, ms=ms,
                                                tflops=attention_flops(batch, heads, seq, dim, causal, False) / ms / 1e9))
                    except Exception as error:  # a tile that does not fit shared memory
                        config_rows.append(dict(dim=dim, seq=seq, causal=causal, blocks=blocks, error=str(error)[:120]))
                for name, fn in implementations().items():
                    for backward in (False, True):
                        try:
                            ms = measure(fn, q, k, v, causal, backward)
                        except Exception as error:
                            rows.append(dict(impl=name, dim=dim, seq=seq, batch=batch, causal=causal, backward=backward,
                                             error=f"{type(error).__name__}: {str(error)[:100]}"))
                            continue
                        tflops = attention_flops(batch, heads, seq, dim, causal, backward) / ms / 1e9
                        rows.append(dict(impl=name, dim=dim, seq=seq, batch=batch, causal=causal, backward=backward,
                                         ms=ms, tflops=tflops, of_peak=tflops / peak))
                print(f"[flash bench] head_dim {dim} seq {seq} done", flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    results = dict(device=device_name, date=datetime.date.today().isoformat(), torch=torch.__version__,
                   triton=__import__("triton").__version__, gemm_peak_tflops=peak, rows=rows, forward_configs=config_rows)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    stem = args.out / f"flash-kernel-{tag}-{results['date']}{'-quick' if args.quick else ''}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2, default=str))
    markdown = render(results)
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)
    return results


def render(results: dict) -> str:
    lines = [
        f"# FlashAttention kernels on {results['device']} ({results['date']})",
        "",
        f"torch {results['torch']}, triton {results['triton']}; bf16; {TOKENS} tokens per batch, hidden {HIDDEN}; "
        f"bf16 GEMM peak measured in the same run: {results['gemm_peak_tflops']:.0f} TFLOP/s. "
        "Command: `python -m benchmarks.flash_kernel`.",
        "",
        "TFLOP/s (fraction of the GEMM peak); forward+backward counts 3.5x the forward's FLOPs.",
        "",
    ]
    impls = list(dict.fromkeys(r["impl"] for r in results["rows"]))
    for backward in (False, True):
        for causal in (False, True):
            lines += [f"## {'forward+backward' if backward else 'forward'}, {'causal' if causal else 'not causal'}", "",
                      "| head_dim | seq | batch | " + " | ".join(impls) + " | ours / SDPA flash |",
                      "|---|---|---|" + "---|" * len(impls) + "---|"]
            keys = sorted({(r["dim"], r["seq"], r["batch"]) for r in results["rows"]})
            for dim, seq, batch in keys:
                cells, by_impl = [], {}
                for impl in impls:
                    row = next((r for r in results["rows"] if r["impl"] == impl and r["dim"] == dim and r["seq"] == seq
                                and r["causal"] == causal and r["backward"] == backward), None)
                    if row is None or "error" in row:
                        cells.append("n/a" if row is None else f"error: {row['error'][:40]}")
                        continue
                    by_impl[impl] = row["tflops"]
                    cells.append(f"{row['tflops']:.0f} ({row['of_peak']:.0%})")
                ratio = by_impl.get("hf_tiny_flash (Triton)", math.nan) / by_impl.get("SDPA flash", math.nan)
                lines.append(f"| {dim} | {seq} | {batch} | " + " | ".join(cells) + f" | {ratio:.2f} |")
            lines.append("")
    lines += ["## Our forward by tile configuration (BLOCK_M, BLOCK_N, warps, stages), TFLOP/s", "",
              "| head_dim | seq | causal | " + " | ".join(str(b) for b in FORWARD_CONFIGS) + " |",
              "|---|---|---|" + "---|" * len(FORWARD_CONFIGS)]
    for dim, seq, causal in sorted({(r["dim"], r["seq"], r["causal"]) for r in results["forward_configs"]}):
        cells = []
        for blocks in FORWARD_CONFIGS:
            row = next(r for r in results["forward_configs"] if (r["dim"], r["seq"], r["causal"]) == (dim, seq, causal)
                       and tuple(r["blocks"]) == tuple(blocks))
            cells.append("error" if "error" in row else f"{row['tflops']:.0f}")
        lines.append(f"| {dim} | {seq} | {causal} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

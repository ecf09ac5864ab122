"""Conversion's time and peak memory on Llama-shaped checkpoints, against `cp -r` of the same folder.

    python -m benchmarks.conversion_memory [--models tinyllama,llama3_8b] [--out benchmarks/results]

Each checkpoint is an official LlamaForCausalLM folder with random bf16 weights (seeded, written one tensor at a
time, so making it needs little memory), cached in $HF_TINY_BENCH_CACHE or ~/.cache/hf_tiny_bench. Each measured
command runs in its own process; its peak RSS is the kernel's (wait4's ru_maxrss). Measured per model:
- `cp -r SRC` (the floor: reading and writing every byte once), before and after the conversion, the faster of
  the two (the conversion reads a source the first copy left in the page cache; the second copy reads it warm too),
- `python -m conversion llama SRC DST` (writing the folder and measuring parity, both streamed),
- loading the result and one 8-token forward (every weight read): hf_tiny's folder with
  AutoModelForCausalLM(trust_remote_code) and the official folder with transformers, each in bf16.
A model whose checkpoint does not fit the free disk (source, copy and result) is skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("HF_TINY_BENCH_CACHE", Path.home() / ".cache" / "hf_tiny_bench"))
RESULTS = Path(__file__).resolve().parent / "results"

SHAPES = {
    "tinyllama": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
    "llama3_8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0),
}
SHARD_SIZE = "5GB"  # as the Hub's Llama checkpoints are sharded
TARGETS = {"tinyllama": 0.5, "llama3_8b": 0.25}  # peak RSS / checkpoint size (issue 35)
# Loading, then one 8-token forward (every weight read once: memory-mapped weights count once they are touched).
LOAD_SCRIPT = """
import sys, torch, transformers
kwargs = {"trust_remote_code": True} if sys.argv[2] == "hf_tiny" else {}
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, **kwargs)
with torch.no_grad():
    print(model(torch.arange(8)[None] + 10).logits.float().abs().max().item())
"""


@dataclass
class Run:
    seconds: float
    peak_rss: int  # bytes
    output: str


def measured(command: list[str], cwd: Path = REPO) -> Run:
    """Runs command in its own process; its wall time and peak resident memory. The peak comes from GNU time
    (`/usr/bin/time -f %M`): a child's ru_maxrss starts at the RSS of the process that forked it, so measuring from
    this (large) process would report at least its own size."""
    with tempfile.NamedTemporaryFile("r", suffix=".maxrss") as peak:
        start = time.perf_counter()
        done = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", peak.name, *command], cwd=cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}")
        kib = int(peak.read().strip().splitlines()[-1])
    return Run(seconds, kib * 1024, done.stdout)


def checkpoint(name: str) -> Path:
    """The cached random official checkpoint (written on first use)."""
    folder = CACHE / f"conversion-{name}"
    if (folder / "config.json").exists():
        return folder
    import transformers

    sys.path.insert(0, str(REPO))
    from conversion.shards import ShardWriter

    config = transformers.LlamaConfig(**SHAPES[name], tie_word_embeddings=False, dtype="bfloat16",
                                      architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        infos = {key: value for key, value in transformers.LlamaForCausalLM(config).state_dict().items()}
    from conversion.lazy import TensorInfo

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    writer = ShardWriter(partial, {k: TensorInfo(tuple(v.shape), torch.bfloat16) for k, v in infos.items()},
                         max_shard_size=SHARD_SIZE)
    generator = torch.Generator().manual_seed(0)
    for key, meta in infos.items():
        if key.endswith("norm.weight"):
            tensor = 1 + 0.1 * torch.randn(meta.shape, generator=generator)
        else:
            tensor = torch.randn(meta.shape, generator=generator) * 0.02
        writer.write(key, tensor.to(torch.bfloat16))
    writer.close()
    config.save_pretrained(partial)
    partial.rename(folder)
    return folder


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.suffix == ".safetensors")


def measure_model(name: str, work: Path) -> dict:
    source = checkpoint(name)
    size = folder_bytes(source)
    free = shutil.disk_usage(work).free
    if free < 2.2 * size:
        return {"model": name, "skipped": f"needs {2.2 * size / 2**30:.1f} GiB free disk, {free / 2**30:.1f} GiB free"}
    copy, converted = work / f"{name}-copy", work / f"{name}-hf_tiny"
    shutil.rmtree(copy, ignore_errors=True)
    copy_run = measured(["cp", "-r", str(source), str(copy)])
    shutil.rmtree(copy)
    convert_run = measured([sys.executable, "-m", "conversion", "llama", str(source), str(converted), "--force"])
    copy_again = measured(["cp", "-r", str(source), str(copy)])
    shutil.rmtree(copy)
    copy_run = min(copy_run, copy_again, key=lambda run: run.seconds)
    load_ours = measured([sys.executable, "-c", LOAD_SCRIPT, str(converted), "hf_tiny"])
    load_official = measured([sys.executable, "-c", LOAD_SCRIPT, str(source), "official"])
    shutil.rmtree(converted)
    return {
        "model": name, "checkpoint_bytes": size, "cp_seconds": copy_run.seconds, "cp_peak_rss": copy_run.peak_rss,
        "convert_seconds": convert_run.seconds, "convert_peak_rss": convert_run.peak_rss,
        "convert_last_line": convert_run.output.strip().splitlines()[-1],
        "load_hf_tiny_seconds": load_ours.seconds, "load_hf_tiny_peak_rss": load_ours.peak_rss,
        "load_official_seconds": load_official.seconds, "load_official_peak_rss": load_official.peak_rss,
        "target_rss_ratio": TARGETS[name],
    }


def report(rows: list[dict], command: str) -> str:
    gib = 2**30
    lines = [f"# Conversion time and peak memory — {time.strftime('%Y-%m-%d')}", "",
             f"Command: `{command}`; machine: {os.cpu_count()} cores, "
             f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / gib:.0f} GiB; torch {torch.__version__}.", "",
             "| model | checkpoint | cp -r | convert | convert / cp | peak RSS convert | RSS / checkpoint | target | met "
             "| load hf_tiny (time, peak RSS) | load official (time, peak RSS) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['model']} | skipped: {row['skipped']} |" + " |" * 9)
            continue
        ratio = row["convert_peak_rss"] / row["checkpoint_bytes"]
        lines.append(
            f"| {row['model']} | {row['checkpoint_bytes'] / gib:.2f} GiB | {row['cp_seconds']:.1f} s "
            f"| {row['convert_seconds']:.1f} s | {row['convert_seconds'] / row['cp_seconds']:.1f}x "
            f"| {row['convert_peak_rss'] / gib:.2f} GiB | {ratio:.2f}x | ≤ {row['target_rss_ratio']}x "
            f"| {'yes' if ratio <= row['target_rss_ratio'] else 'no'} "
            f"| {row['load_hf_tiny_seconds']:.1f} s, {row['load_hf_tiny_peak_rss'] / gib:.2f} GiB "
            f"| {row['load_official_seconds']:.1f} s, {row['load_official_peak_rss'] / gib:.2f} GiB |")
    lines += ["", "The conversion's last line (what it wrote, parity):", ""]
    lines += [f"- {row['model']}: `{row['convert_last_line']}`" for row in rows if "skipped" not in row]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.conversion_memory", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tinyllama,llama3_8b", help=f"comma-separated subset of {','.join(SHAPES)}")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=CACHE / "conversion-work", help="where copies and results go")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {', '.join(SHAPES)}")
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        print(f"[conversion_memory] {name}", file=sys.stderr, flush=True)
        rows.append(measure_model(name, args.work))
    command = "python -m benchmarks.conversion_memory " + " ".join(argv if argv is not None else sys.argv[1:])
    stem = args.out / f"conversion-memory-{time.strftime('%Y-%m-%d')}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    stem.with_suffix(".md").write_text(report(rows, command.strip()))
    print(report(rows, command.strip()))


if __name__ == "__main__":
    main()

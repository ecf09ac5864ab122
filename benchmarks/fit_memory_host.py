"""The host work of the fit_memory path where a training step fits: what the option costs a GPU's host.

    python -m benchmarks.fit_memory_host [--layers 22] [--out FILE.md]

On a GPU a training step of a small model is host-bound in part, and fit_memory (hf_tiny/memory_fit.py) reads the
allocator's counters once a layer and walks the model's modules once a step. The CPU has no CUDA allocator, so its
counters are stood in for by a nested dict of the layout torch.cuda.memory_stats_as_nested_dict returns (every
counter at 0); torch's own Python around them runs as on a GPU. Counted (cProfile, built-ins included) and timed on
this CPU:

- one read of the allocated bytes through torch.cuda.memory_allocated (which flattens and sorts every counter in
  Python) and through the nested form the plan reads;
- a training step (forward, backward) of a random Llama of --layers layers at width 64, fit_memory off and on, the
  device's memory ample (every layer runs as written), and the plan's walk over the model's modules alone.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import time
from pathlib import Path
from unittest import mock

import torch

from . import measure
from .machine import cpu_model, git_revision

COUNTERS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes", "active_bytes",
            "inactive_split_bytes", "requested_bytes")
STATS = ("current", "peak", "allocated", "freed")


def allocator_counters() -> dict:
    """The layout of torch.cuda.memory_stats_as_nested_dict (torch 2.10-2.15), every counter at 0."""
    pools = ("all", "small_pool", "large_pool")
    nested = {name: {pool: dict.fromkeys(STATS, 0) for pool in pools} for name in COUNTERS}
    nested.update(dict.fromkeys(("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                                 "num_device_free", "max_split_size"), 0))
    nested.update(oversize_allocations=dict.fromkeys(STATS, 0), oversize_segments=dict.fromkeys(STATS, 0))
    return nested


@contextlib.contextmanager
def stand_in_cuda(free_bytes: int = 10**15):
    """The CUDA allocator's counters and free memory stood in for; hf_tiny's runtime counts memory on this CPU."""
    from hf_tiny import memory_fit, runtime

    counters = allocator_counters()
    with mock.patch.object(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: counters), \
            mock.patch.object(torch.cuda.memory, "memory_stats_as_nested_dict", lambda device=None: counters), \
            mock.patch.object(torch.cuda, "is_initialized", lambda: True), \
            mock.patch.object(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, free_bytes)), \
            mock.patch.object(runtime, "counts_memory", lambda device: True), \
            mock.patch.object(memory_fit, "counts_memory", lambda device: True):
        yield


def per_call(fn, repeats: int) -> tuple[int, float]:
    """(Python calls of one call, microseconds a call over `repeats`)."""
    fn()
    calls = measure.count_python_calls(fn)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return calls, (time.perf_counter() - start) / repeats * 1e6


def training_model(layers: int):
    from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM

    torch.manual_seed(0)
    config = TinyCausalConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                              num_attention_heads=8, num_key_value_heads=2)
    model = TinyCausalForCausalLM(config)
    ids = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(0))

    def step():
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    return model, step


def measure_all(layers: int) -> list[tuple[str, int, float]]:
    from hf_tiny import memory_fit, runtime

    rows = []
    with stand_in_cuda():
        device = torch.device("cuda", 0)
        rows.append(("torch.cuda.memory_allocated, one read",
                     *per_call(lambda: torch.cuda.memory_allocated(device), 1000)))
        rows.append(("memory_fit.allocated_bytes (the nested form), one read",
                     *per_call(lambda: memory_fit.allocated_bytes(device), 1000)))
        model, step = training_model(layers)
        paths = dict(recompute=False, in_place=False, few_rows=False, chunked_loss=False, rebuild=False)
        model.set_runtime(True, fit_memory=False, **paths)
        rows.append((f"training step, {layers} layers, fit_memory off", *per_call(step, 30)))
        model.set_runtime(True, fit_memory=True, **paths)
        rows.append((f"training step, {layers} layers, fit_memory on (every layer fits)", *per_call(step, 30)))
        rows.append(("the plan's walk over the modules (memory_fit.census)",
                     *per_call(lambda: memory_fit.census(model, runtime._is_runtime_layer), 200)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=22, help="decoder layers (TinyLlama-1.1B's: 22)")
    parser.add_argument("--out", type=Path, help="also write the table, with the machine and versions, to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    header = (f"fit_memory's host work, {datetime.date.today()}, {cpu_model()} ({platform.machine()}), 1 thread, "
              f"torch {torch.__version__}, hf_tiny {git_revision()}: `python -m benchmarks.fit_memory_host "
              f"--layers {args.layers}`")
    lines = ["| work | Python calls | µs a call |", "|---|---|---|"]
    lines += [f"| {name} | {calls:,} | {micros:,.1f} |" for name, calls, micros in measure_all(args.layers)]
    measure.print_table(header, lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

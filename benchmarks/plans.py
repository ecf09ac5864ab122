"""What a run of `benchmarks.run` measures on a device: the shapes of each case, repeats, and the models."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .workloads import Shape


@dataclass
class Plan:
    prefill: dict  # family -> Shape
    train: dict  # family -> Shape
    decode: list  # Shapes (causal)
    sweep_lengths: list
    repeats: int
    warmup: int
    gemm_n: int
    bandwidth_mb: int
    models: list = field(default_factory=list)


def make_plan(device: torch.device, quick: bool) -> Plan:
    cuda = device.type == "cuda"
    if quick:
        return Plan(
            prefill={"encoder": Shape(8, 64), "causal": Shape(1, 128)},
            train={"encoder": Shape(8, 64), "causal": Shape(1, 64)},
            decode=[Shape(1, 16, 16), Shape(8, 16, 16)],
            sweep_lengths=[128, 256, 512] if not cuda else [512, 2048, 8192],
            repeats=5,
            warmup=1,
            gemm_n=2048 if not cuda else 4096,
            bandwidth_mb=512 if not cuda else 1024,
            models=["minilm", "smollm2", "overhead"],
        )
    return Plan(
        prefill={"encoder": Shape(32, 128), "causal": Shape(4, 256)},  # issue 17's prefill shapes
        # SmolLM2 at 4x512 as issue 17 states its memory target (a step takes ~20 s on 2 CPU cores).
        train={"encoder": Shape(32, 128), "causal": Shape(4, 512)},
        decode=[Shape(1, 32, 128), Shape(8, 32, 128)],
        sweep_lengths=[256, 512, 1024, 2048] if not cuda else [512, 1024, 2048, 4096, 8192, 16384],
        repeats=5,
        warmup=1,
        gemm_n=2048 if not cuda else 8192,
        bandwidth_mb=512 if not cuda else 4096,
        models=["minilm", "smollm2", "overhead", "llama1b"] if cuda else ["minilm", "smollm2", "overhead"],
    )

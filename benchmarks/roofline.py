"""Analytic work counts (FLOPs, bytes) from a config, and the machine ceilings measured in the same run.

FLOPs of a forward over B sequences of S tokens (multiply-add = 2 FLOPs; element-wise work is not counted):
    2 · (matmul parameters of the blocks) · B·S                       q, k, v, o and the feed-forward matrices
  + 4 · L · H · D · (visible key count summed over queries) · B       Q·Kᵀ and P·V; S² (encoder) or S(S+1)/2 (causal)
  + 2 · hidden · vocab · (positions whose logits are computed)         LM head (causal only)
A training step counts 3× its forward (the backward pass is two matmuls per forward one).

Decode bytes of generate(): every step reads every weight matrix once (embedding rows are gathered, so only the
LM head reads the vocabulary matrix) plus the K/V cache of each sequence so far:
    per step t: W + 2 · L · Hkv · D · (prompt + t) · B · bytes_per_value
This is the minimum traffic of the algorithm, not what an implementation happens to move (a growing
torch.cat cache copies more), so bytes/s against the measured bandwidth is the headroom that is left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .measure import synchronize


@dataclass(frozen=True)
class Arch:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    causal: bool

    @classmethod
    def from_config(cls, config, family: str) -> "Arch":
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            gated_mlp=family == "causal",
            causal=family == "causal",
        )

    @property
    def block_matmul_params(self) -> int:
        """Weights of the q/k/v/o and feed-forward matrices of all layers (biases are element-wise work)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.layers * (attention + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab if self.causal else 0


def counted_block_matmul_params(model) -> int:
    """Weights of the nn.Linear layers inside the transformer blocks of a loaded model (BERT: encoder.layer.N,
    Llama: model.layers.N): the run checks the analytic count against it."""
    return sum(
        module.weight.numel()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and (".layer." in f".{name}" or ".layers." in f".{name}")
    )


def forward_flops(arch: Arch, batch: int, seq: int, *, logits_positions: int) -> float:
    """FLOPs of one forward over batch × seq fresh tokens, logits computed at `logits_positions` per sequence."""
    visible = seq * (seq + 1) // 2 if arch.causal else seq * seq
    attention = 4 * arch.layers * arch.heads * arch.head_dim * visible * batch
    lm_head = 2 * arch.lm_head_params * logits_positions * batch
    return 2.0 * arch.block_matmul_params * batch * seq + attention + lm_head


def train_flops(arch: Arch, batch: int, seq: int) -> float:
    positions = seq if arch.causal else 0
    return 3.0 * forward_flops(arch, batch, seq, logits_positions=positions)


def generate_bytes(arch: Arch, *, batch: int, prompt: int, new_tokens: int, bytes_per_value: int) -> float:
    """Minimum bytes read by a generate() of `new_tokens` steps (the first step is the prompt's prefill)."""
    weights = (arch.block_matmul_params + arch.lm_head_params) * bytes_per_value
    kv_per_token = 2 * arch.layers * arch.kv_heads * arch.head_dim * bytes_per_value
    context_sum = sum(prompt + step for step in range(new_tokens))  # keys visible to the new query of each step
    return new_tokens * weights + kv_per_token * context_sum * batch


def generate_flops(arch: Arch, *, batch: int, prompt: int, new_tokens: int) -> float:
    prefill = forward_flops(arch, batch, prompt, logits_positions=1)
    per_step = 2.0 * (arch.block_matmul_params + arch.lm_head_params) * batch
    attention = sum(4 * arch.layers * arch.heads * arch.head_dim * (prompt + step) * batch for step in range(1, new_tokens))
    return prefill + per_step * (new_tokens - 1) + attention


# ---- ceilings measured in the same run ---------------------------------------------------------------------------

def _best_seconds(fn, device: torch.device, repeats: int, clock) -> float:
    """The fastest of `repeats` calls: a ceiling is what the machine can do, not what it did under load."""
    fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = clock()
        fn()
        synchronize(device)
        samples.append(clock() - start)
    return min(samples)


def gemm_peak(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 7, clock=time.perf_counter) -> dict:
    """FLOP/s of a large square torch.matmul (n × n by n × n) in the benchmark dtype, timed with the same clock
    as the cases (fastest call)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _best_seconds(lambda: torch.matmul(a, b), device, repeats, clock)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "flops_per_s": 2.0 * n**3 / seconds}


def memory_bandwidth(device: torch.device, megabytes: int, repeats: int = 7, clock=time.perf_counter) -> dict:
    """Bytes/s of a large copy (read + write counted) and of a sum (read only) over a fp32 tensor (fastest call)."""
    count = megabytes * 1024 * 1024 // 4
    src = torch.rand(count, device=device)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), device, repeats, clock)
    sum_s = _best_seconds(lambda: src.sum(), device, repeats, clock)
    nbytes = count * 4
    return {"megabytes": megabytes, "copy_bytes_per_s": 2 * nbytes / copy_s, "read_bytes_per_s": nbytes / sum_s}


def best_ceilings(*measurements: dict) -> dict:
    """Combines ceilings measured at several moments of a run (start, end): the best of each."""
    gemm = max((m["gemm"] for m in measurements), key=lambda g: g["flops_per_s"])
    bandwidth = dict(max((m["bandwidth"] for m in measurements), key=lambda b: b["read_bytes_per_s"]))
    bandwidth["copy_bytes_per_s"] = max(m["bandwidth"]["copy_bytes_per_s"] for m in measurements)
    return {"gemm": gemm, "bandwidth": bandwidth, "measured": list(measurements)}

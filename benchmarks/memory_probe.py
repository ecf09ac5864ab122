"""Peak CPU memory of one case in a fresh interpreter: `python -m benchmarks.memory_probe '<json spec>'`.

Started by measure.run_memory_probe (with MALLOC_MMAP_THRESHOLD_ set; see measure.py for the method). Prints
one JSON line: {"peak_bytes": ..., "base_rss_bytes": ...} or {"error": ...}.

spec keys: model, impl, folder, dtype, attn, case, batch, seq, new_tokens, calls, prefill_extra
           or {"case": "calibrate", "bytes": N} to check the method on a known allocation.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .measure import _proc_status_kib, rss_peak_bytes
from .models import MODELS, load_model
from .workloads import Shape, build


def _touch(model) -> None:
    # Weights loaded from safetensors may be file-backed pages that only become resident when first read:
    # read them all now so that the measured peak holds only what the call itself allocates.
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.float().sum()


def probe(spec: dict) -> dict:
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    if spec["case"] == "calibrate":
        count = spec["bytes"] // 4

        def allocate():
            block = torch.ones(count, dtype=torch.float32)
            return float(block[-1])

        return {"peak_bytes": rss_peak_bytes(allocate, calls=1), "expected_bytes": count * 4}
    model_spec = MODELS[spec["model"]]
    model = load_model(
        model_spec,
        spec["impl"],
        Path(spec["folder"]),
        dtype=getattr(torch, spec["dtype"]),
        device=torch.device("cpu"),
        attn=spec["attn"],
    )
    if spec.get("drop_pooler"):
        model.pooler = None
    _touch(model)
    shape = Shape(spec["batch"], spec["seq"], spec.get("new_tokens", 0))
    fn = build(spec["case"], model, model_spec.family, shape, torch.device("cpu"), spec.get("prefill_extra"))
    base = _proc_status_kib("VmRSS") * 1024
    return {"peak_bytes": rss_peak_bytes(fn, calls=spec.get("calls", 2)), "base_rss_bytes": base}


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        result = probe(spec)
    except Exception as error:  # reported to the parent as data; the parent decides what to print
        result = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Runs under `torchrun --nproc_per_node=2` for tests/ecosystem/test_distributed.py (one launch serves every distributed test:
starting processes costs more than the tiny runs themselves).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/helpers/ddp_worker.py JOBS.json

JOBS.json: a list of jobs, run in order on every process:
  {"kind": "example", "family": "causal", "argv": [...]}   an example script's main(argv) (DDP, or --fsdp native);
                                                           the script writes its results JSON (--results-json)
  {"kind": "tensor_parallel", "model_dir": DIR, "auto_class": "AutoModelForCausalLM", "batch": {...}, "out": FILE}
      from_pretrained(DIR, distributed_config=DistributedConfig(tp_size=world size)); the main process writes the
      logits of `batch`, the local shapes of the sharded weights, or the error raised, to FILE.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_runs  # noqa: E402  (puts examples/ on sys.path)


def run_example(job: dict) -> None:
    trainer_runs.EXAMPLES[job["family"]].main(job["argv"])


def run_tensor_parallel(job: dict) -> None:
    import transformers
    from transformers.distributed import DistributedConfig

    import hf_tiny  # noqa: F401  (registers the Auto classes)

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    auto_class = getattr(transformers, job["auto_class"])
    result: dict = {}
    try:
        model = auto_class.from_pretrained(
            job["model_dir"], distributed_config=DistributedConfig(tp_size=dist.get_world_size())
        ).eval()
    except (ValueError, TypeError, NotImplementedError) as error:
        result = {"error": f"{type(error).__name__}: {error}"}
    else:
        batch = {key: torch.tensor(value) for key, value in job["batch"].items()}
        with torch.no_grad():
            logits = model(**batch).logits
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        result = {
            "logits": logits.tolist(),
            "model_class": type(model).__name__,
            "local_shapes": {
                name: list(getattr(param, "to_local", lambda p=param: p)().shape)
                for name, param in model.named_parameters()
            },
        }
    if dist.get_rank() == 0:
        Path(job["out"]).write_text(json.dumps(result))
    dist.barrier()


def main(jobs_file: str) -> None:
    runners = {"example": run_example, "tensor_parallel": run_tensor_parallel}
    for job in json.loads(Path(jobs_file).read_text()):
        runners[job["kind"]](job)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1])

"""Drive the Trainer examples (examples/finetune_*.py) from the tests with tiny configs: the tests check what a
user runs. Used by tests/ecosystem/test_trainer.py and tests/ecosystem/test_distributed.py (and by torchrun in the latter)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = REPO_ROOT / "examples"
if str(EXAMPLES_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLES_DIR))

import finetune_causal  # noqa: E402
import finetune_common  # noqa: E402
import finetune_encoder  # noqa: E402
import finetune_seq2seq  # noqa: E402

EXAMPLES = {"encoder": finetune_encoder, "causal": finetune_causal, "seq2seq": finetune_seq2seq}
loss_curve = finetune_common.loss_curve
grad_norm_curve = finetune_common.grad_norm_curve


def tiny_args(family: str, output_dir, *flags: str):
    """The example's own argument parser, with --tiny and no final evaluation/save (training only)."""
    return EXAMPLES[family].parse_args(["--tiny", "--skip-final", "--output-dir", str(output_dir), *flags])


def make_trainer(family: str, output_dir, *flags: str, train_rows=None):
    return EXAMPLES[family].make_trainer(tiny_args(family, output_dir, *flags), train_rows=train_rows)


def train(family: str, output_dir, *flags: str, resume=None, train_rows=None, configure=None):
    """Build the example's Trainer, let `configure(trainer)` adjust it, train; returns the trainer."""
    trainer = make_trainer(family, output_dir, *flags, train_rows=train_rows)
    if configure is not None:
        configure(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def final_state(trainer) -> dict[str, torch.Tensor]:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}


def max_state_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)

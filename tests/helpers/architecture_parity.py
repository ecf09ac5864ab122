"""Prints max |ours - official| of the logits at real tokens (fp32 CPU, the left-padded batch of the parity tests)
for every MoE / DeepSeek-V3 / MPT variant the tests convert, per backend (and MLA's absorbed path). The
Mixtral / Qwen-MoE / DeepSeek-V3 / MPT parity rows of docs/parity.md come from it:

    python tests/helpers/architecture_parity.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging  # noqa: E402

import hf_tiny  # noqa: E402, F401
import deepseek_models  # noqa: E402
import moe_models  # noqa: E402
import mpt_models  # noqa: E402
from causal_helpers import left_padded_batch, max_diff, real_logits, tiny_official  # noqa: E402
from conversion import llama, mpt  # noqa: E402


def row(name: str, official, folder: Path, extras=()) -> str:
    batch = left_padded_batch(official.config.vocab_size)
    cells = [name]
    for backend in ("eager", "sdpa"):
        official.set_attn_implementation(backend)
        expected = real_logits(official, batch)
        ours = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=backend).eval()
        cells.append(f"{backend} {max_diff(real_logits(ours, batch), expected):.2g}")
    for overrides in extras:
        ours = AutoModelForCausalLM.from_pretrained(folder, **overrides).eval()
        cells.append(f"{overrides} {max_diff(real_logits(ours, batch), expected):.2g}")
    cells.append(f"max |logit| {float(expected.abs().max()):.3g}")
    return " | ".join(cells)


def converted(official, converter) -> Path:
    folder = Path(tempfile.mkdtemp())
    official.save_pretrained(folder / "src")
    converter.convert(folder / "src", folder / "ours")
    return folder / "ours"


def main() -> None:
    logging.disable_progress_bar()
    for variant, (family, overrides) in sorted(moe_models.VARIANTS.items()):
        official = tiny_official(family, **overrides)
        print(row(variant, official, converted(official, llama)))
    for variant in sorted(deepseek_models.VARIANTS):
        official = deepseek_models.tiny_deepseek(variant)
        print(row(f"deepseek_v3 {variant}", official, converted(official, llama), extras=({"mla_absorb": True},)))
    for heads in (4, 6):
        official = mpt_models.tiny_mpt(heads)
        print(row(f"mpt {heads} heads", official, converted(official, mpt)))


if __name__ == "__main__":
    main()

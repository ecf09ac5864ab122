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
    demo_smollm2.run(args.workdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

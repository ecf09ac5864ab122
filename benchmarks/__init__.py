"""Side-by-side benchmarks: hf_tiny against official transformers on the same weights, dtype and backend.

Run `python -m benchmarks.run --device cpu --quick` (minutes) or without `--quick` for the issue's shapes;
see benchmarks/README.md for what is measured and how.
"""

"""hf_tiny: transformer models written from scratch in PyTorch, first-class Hugging Face citizens.

Importing hf_tiny registers every config and model class with the transformers Auto classes.
"""

from .attention import ATTENTION_BACKENDS, get_attention_backend

__version__ = "0.1.0"

# Families register themselves below (one import block each).

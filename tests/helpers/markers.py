"""Test markers shared by the suite's folders (`from markers import cuda_only`)."""

from __future__ import annotations

import pytest
import torch

CUDA_SKIP_REASON = "needs a CUDA GPU; torch.cuda.is_available() is False on this machine"


def cuda_only(test):
    """Decorator: marks a test or class `cuda`, skipped with a reason without a GPU. A plain `@pytest.mark.cuda` is
    skipped the same way by tests/conftest.py's pytest_collection_modifyitems."""
    test = pytest.mark.cuda(test)
    return pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_SKIP_REASON)(test)

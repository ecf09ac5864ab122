"""Where the PyPI weight packages keep their files, found without importing them (tests/conftest.py's fixtures)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(package: str) -> Optional[Path]:
    """Folder of an installed data package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])

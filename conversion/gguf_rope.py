"""llama.cpp's `rope_freqs.weight` read back as the RoPE scaling it was computed from.

llama.cpp's converter stores Llama 3.1+'s RoPE scaling (`rope_type` "llama3") as one factor per frequency:

    wavelength < original / high_freq_factor   ->  1
    wavelength > original / low_freq_factor    ->  factor
    in between, smooth = (original / wavelength - low) / (high - low)  ->  1 / ((1 - smooth) / factor + smooth)

transformers' GGUF loader has no name for that tensor and drops it, so its model computes RoPE unscaled. Here the
factors are turned back into `rope_parameters`: the in-between factors fix original / (high - low) and
low / (high - low), so with low_freq_factor 1 (Meta's) the others follow, and the result is accepted only if
transformers' own llama3 RoPE gives back every stored factor.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .errors import ConversionError

RELATIVE_TOLERANCE = 1e-5  # the factors are stored as float32


def llama3_rope_parameters(path: Path, factors: torch.Tensor, config: dict) -> dict:
    """The llama3 `rope_parameters` whose per-frequency factors are `factors` (refused where none are)."""
    factors = factors.double().flatten()
    factor = float(factors.max())
    between = (factors > 1) & (factors < factor)
    if float(factors.min()) != 1.0 or int(between.sum()) < 2:
        raise _not_llama3(path, factors, f"{int(between.sum())} factors between 1 and the largest, need >= 2")
    default = _inverse_frequencies(config, {"rope_type": "default", "rope_theta": config["rope_theta"]})
    if default.numel() != factors.numel():
        raise _not_llama3(path, factors, f"{factors.numel()} factors for {default.numel()} rotary frequencies")
    smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
    inverse_wavelength = default.double()[between] / (2 * math.pi)
    design = torch.stack([inverse_wavelength, torch.ones_like(inverse_wavelength)], dim=1)
    slope, offset = torch.linalg.lstsq(design, smooth.unsqueeze(1)).solution.flatten().tolist()
    if offset >= 0 or slope <= 0:
        raise _not_llama3(path, factors, "the factors do not rise with the wavelength as llama3's do")
    high_freq_factor = round(1 - 1 / offset, 4)
    parameters = {
        "rope_type": "llama3",
        "rope_theta": config["rope_theta"],
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": high_freq_factor,
        "original_max_position_embeddings": round(slope * (high_freq_factor - 1)),
    }
    scaled = _inverse_frequencies(config, parameters).double()
    worst = float(((default.double() / scaled) / factors - 1).abs().max())
    if worst > RELATIVE_TOLERANCE:
        raise _not_llama3(path, factors, f"the closest llama3 parameters {parameters} are off by {worst:.2g}")
    return parameters


def _inverse_frequencies(config: dict, rope_parameters: dict) -> torch.Tensor:
    """transformers' own inverse frequencies for a Llama config dict with these rope_parameters."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    fields = {key: value for key, value in config.items() if key != "rope_theta"}
    llama = LlamaConfig(**{**fields, "rope_parameters": rope_parameters})
    if rope_parameters["rope_type"] == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(llama)[0]
    return ROPE_INIT_FUNCTIONS["llama3"](llama, "cpu")[0]


def _not_llama3(path: Path, factors: torch.Tensor, why: str) -> ConversionError:
    return ConversionError(
        f"{path}: rope_freqs.weight holds llama.cpp's per-frequency RoPE scaling factors "
        f"({float(factors.min()):g} .. {float(factors.max()):g}) that are not Llama 3.1's scaling ({why}); "
        "transformers' GGUF loader drops them (its model would compute RoPE unscaled): convert the source Hugging "
        "Face folder instead, whose config.json states the scaling (rope_parameters)"
    )

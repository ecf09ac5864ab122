"""Rotary position embeddings (RoPE): the frequencies of every scaling variant, and the checks of rope_parameters
(the module that turns positions into cos/sin, and applying them, are layers.py's RotaryEmbedding / apply_rotary).

Scaling variants follow transformers' `modeling_rope_utils.py` and its `rope_parameters` dict exactly (same
fields, same defaults, same float32 arithmetic), so a converted checkpoint rotates queries and keys the way the
official model does:

    default   inv_freq[i] = 1 / theta^(2i / d)
    linear    inv_freq / factor                                  (position interpolation)
    dynamic   theta grows with the sequence length past max_position_embeddings (NTK-aware, recomputed at run time)
    yarn      per-frequency blend of interpolation / extrapolation, cos/sin scaled by attention_factor
    llama3    low frequencies / factor, high ones kept, smooth ramp in between (Llama 3.1)
    longrope  per-frequency short_factor / long_factor (Phi-3), the long set once the sequence passes
              original_max_position_embeddings (recomputed at run time), cos/sin scaled by attention_factor

`partial_rotary_factor` < 1 rotates only the first int(head_dim * factor) dimensions of each head (Phi-4-mini);
the rest pass through unrotated.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

DEFAULT_ROPE_THETA = 10000.0
# The layer types rope_parameters may be keyed by (chunked layers rotate with the full layers' parameters).
ROPE_LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# rope types whose inverse frequencies depend on the current sequence length (no precomputed table)
SEQUENCE_DEPENDENT_TYPES = ("dynamic", "longrope")
# Fields each rope type needs besides rope_type / rope_theta (transformers' `_validate_<type>_rope_parameters`).
REQUIRED_ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
_NUMERIC_ROPE_FIELDS = (
    "rope_theta",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)
# A cos/sin table over every position costs 2 * positions * head_dim floats: above this many positions (long
# context models) cos/sin are computed from the positions at each call instead.
MAX_TABLE_POSITIONS = 16384


# ----------------------------------------------------------------------------------------------------------------
# rope_parameters: standardize + validate
# ----------------------------------------------------------------------------------------------------------------


def rope_parameter_sets(rope) -> list[dict]:
    """The parameter dicts of a rope_parameters value: the layer types' where it is keyed by them (Gemma 3, ModernBERT;
    transformers 5.16-5.17 leave a flat rope_type / rope_theta beside them, which no layer reads), else itself; none
    for None."""
    if not isinstance(rope, dict):
        return []
    if set(rope) & set(ROPE_LAYER_TYPES):
        return [rope[kind] for kind in ROPE_LAYER_TYPES if isinstance(rope.get(kind), dict)]
    return [rope]


def uses_longrope(rope) -> bool:
    """Whether rope_parameters (or a legacy rope_scaling, whose key is "type") name rope_type "longrope"."""
    return any(params.get("rope_type", params.get("type")) == "longrope" for params in rope_parameter_sets(rope))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def standardize_rope_parameters(
    rope_parameters: Optional[dict],
    *,
    max_position_embeddings: int,
    rope_theta: Optional[float] = None,
    owner: str = "rope_parameters",
) -> dict:
    """A validated copy of `rope_parameters` with transformers' defaults filled in.

    Accepts the legacy spelling too (`type` for `rope_type`; `rope_theta` given beside the dict, as in
    `rope_scaling` + `rope_theta` configs). Defaults as transformers' `standardize_rope_params`: rope_type
    "default", rope_theta 10000, and for yarn / llama3 original_max_position_embeddings = max_position_embeddings.
    """
    if rope_parameters is not None and not isinstance(rope_parameters, dict):
        raise TypeError(f"{owner}: rope_parameters must be a dict or None, got {type(rope_parameters).__name__}")
    params = dict(rope_parameters or {})
    legacy_type = params.pop("type", None)
    params.setdefault("rope_type", legacy_type if legacy_type is not None else "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = DEFAULT_ROPE_THETA if rope_theta is None else rope_theta
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{owner}: unknown rope_parameters['rope_type'] {rope_type!r}; hf_tiny supports {list(ROPE_TYPES)}"
        )
    if rope_type in ("yarn", "llama3", "longrope"):
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    _check_rope_values(params, owner)
    return params


def _check_rope_values(params: dict, owner: str) -> None:
    """Each field rope_type needs is present, and every value is in range."""
    rope_type = params["rope_type"]
    for field in REQUIRED_ROPE_FIELDS[rope_type]:
        if field not in params:
            raise ValueError(
                f"{owner}: rope_parameters for rope_type {rope_type!r} needs the field {field!r}; "
                f"got {sorted(params)} (rope_parameters={params})"
            )
        value = params[field]
        if value is None and not (rope_type == "yarn" and field == "factor"):  # yarn derives a None factor
            raise ValueError(f"{owner}: rope_parameters[{field!r}] must be a number for rope_type {rope_type!r}, got None")
    for field in _NUMERIC_ROPE_FIELDS:
        value = params.get(field)
        if value is not None and not _is_number(value):
            raise ValueError(f"{owner}: rope_parameters[{field!r}] must be a number, got {value!r}")
    if not params["rope_theta"] > 0:
        raise ValueError(f"{owner}: rope_parameters['rope_theta'] must be > 0, got {params['rope_theta']!r}")
    factor = params.get("factor")
    if factor is not None and not factor > 0:
        raise ValueError(f"{owner}: rope_parameters['factor'] must be > 0, got {factor!r}")
    original = params.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original <= 0):
        raise ValueError(
            f"{owner}: rope_parameters['original_max_position_embeddings'] must be a positive integer, got {original!r}"
        )
    if rope_type == "llama3" and params["high_freq_factor"] == params["low_freq_factor"]:
        raise ValueError(
            f"{owner}: rope_parameters['high_freq_factor'] ({params['high_freq_factor']}) must differ from "
            f"rope_parameters['low_freq_factor'] ({params['low_freq_factor']})"
        )
    partial = params.get("partial_rotary_factor", 1.0)
    if not _is_number(partial) or not 0 < partial <= 1:
        raise ValueError(f"{owner}: rope_parameters['partial_rotary_factor'] must be in (0, 1], got {partial!r}")
    if rope_type == "longrope":
        for field in ("short_factor", "long_factor"):
            factors = params[field]
            if not isinstance(factors, (list, tuple)) or not factors or not all(
                _is_number(value) and value > 0 for value in factors
            ):
                raise ValueError(f"{owner}: rope_parameters[{field!r}] must be a list of positive numbers, got {factors!r}")


def rotary_dim(rope_parameters: dict, head_dim: int, owner: str = "rope_parameters") -> int:
    """How many leading dimensions of each head rotate: int(head_dim * partial_rotary_factor), even; longrope's
    factor lists must hold one entry per rotary frequency (rotary_dim / 2)."""
    partial = rope_parameters.get("partial_rotary_factor", 1.0)
    dim = int(head_dim * partial)
    if dim < 2 or dim % 2:
        raise ValueError(
            f"{owner}: head_dim {head_dim} x partial_rotary_factor {partial} = {dim} rotary dimensions; it must be "
            "an even number >= 2"
        )
    if rope_parameters["rope_type"] == "longrope":
        for field in ("short_factor", "long_factor"):
            if len(rope_parameters[field]) != dim // 2:
                raise ValueError(
                    f"{owner}: rope_parameters[{field!r}] has {len(rope_parameters[field])} entries; {dim} rotary "
                    f"dimensions need {dim // 2}"
                )
    return dim


# ----------------------------------------------------------------------------------------------------------------
# inverse frequencies: one function per rope type, the arithmetic of transformers' modeling_rope_utils.py
# ----------------------------------------------------------------------------------------------------------------


def _default_inv_freq(base, dim: int, device) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))


def _linear(params, dim, max_positions, device, seq_len):
    inv_freq = _default_inv_freq(params["rope_theta"], dim, device)
    inv_freq /= params["factor"]
    return inv_freq, 1.0


def _dynamic(params, dim, max_positions, device, seq_len):
    factor = params["factor"]
    if seq_len is None:
        seq_len = max_positions
    elif isinstance(seq_len, torch.Tensor):
        seq_len = torch.maximum(seq_len, torch.tensor(max_positions, dtype=seq_len.dtype, device=seq_len.device))
    else:
        seq_len = max(seq_len, max_positions)
    base = params["rope_theta"] * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(base, dim, device), 1.0


def _yarn(params, dim, max_positions, device, seq_len):
    base = params["rope_theta"]
    factor = params.get("factor")
    attention_factor = params.get("attention_factor")
    mscale = params.get("mscale")
    mscale_all_dim = params.get("mscale_all_dim")
    original_max = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_positions / original_max

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp.to(device=device, dtype=torch.float)
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_weight) + inv_freq_extrapolation * extrapolation_weight
    )
    return inv_freq, attention_factor


def _llama3(params, dim, max_positions, device, seq_len):
    inv_freq = _default_inv_freq(params["rope_theta"], dim, device)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama), 1.0


def _longrope(params, dim, max_positions, device, seq_len):
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # Phi-3 keeps the pre-extension length beside max_position_embeddings
        factor = max_positions / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    long = seq_len is not None and seq_len > original_max
    ext_factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext_factors * params["rope_theta"] ** inv_freq_shape), attention_factor


def _default(params, dim, max_positions, device, seq_len):
    return _default_inv_freq(params["rope_theta"], dim, device), 1.0


_INV_FREQ_FUNCTIONS = {
    "default": _default, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3, "longrope": _longrope,
}


def compute_inv_freq(
    rope_parameters: dict,
    head_dim: int,
    max_position_embeddings: int,
    *,
    device: Optional[torch.device] = None,
    seq_len=None,
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention_scaling) for standardized rope_parameters; head_dim here is
    the number of rotary dimensions.

    seq_len matters only for "dynamic" and "longrope" (the current sequence length, int or 0-d tensor).
    """
    function = _INV_FREQ_FUNCTIONS[rope_parameters["rope_type"]]
    return function(rope_parameters, head_dim, max_position_embeddings, device, seq_len)

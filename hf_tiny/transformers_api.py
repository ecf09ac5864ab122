"""The parts of transformers' contract that differ across the versions hf_tiny supports, each read in one place.

- The tested range (TESTED_TRANSFORMERS): the suite passes on both ends. Outside it hf_tiny warns once, naming the
  installed and the tested versions, and before a model class first generates it checks that cached greedy
  decoding gives the logits of uncached decoding: a release that renames what generation passes then stops with a
  clear error instead of producing garbage text (transformers 5.24 did exactly that to the cache argument).
- The cache's two names (`cache` from 5.24 on, `past_key_values` before) are read where every forward's arguments
  are: step.py (`cache_arguments`, `with_cache`, `cache_of`).
"""

from __future__ import annotations

import re
import warnings
from typing import Optional

import torch
import transformers

# Oldest and newest transformers the whole suite passed on (CI runs both ends). Raise the upper bound here, in
# pyproject.toml and in the README together, after the suite passes on the new version.
TESTED_TRANSFORMERS = ("5.16.1", "5.24.0")
# The torch the README's set-up commands pin and CI runs.
TESTED_TORCH = "2.13.0"


def tested_range_text() -> str:
    return f">={TESTED_TRANSFORMERS[0]},<={TESTED_TRANSFORMERS[1]}"


def _release(version: str) -> tuple[int, int, int]:
    """The release numbers of a version string: "5.25.0.dev0" -> (5, 25, 0), "5.24" -> (5, 24, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    if match is None:
        raise ValueError(f"not a version number: {version!r}")
    numbers = [int(part) for part in match.group(0).split(".")][:3]
    return tuple(numbers + [0] * (3 - len(numbers)))


def in_tested_range(version: Optional[str] = None) -> bool:
    """Whether `version` (default: the installed transformers) lies in the tested range; a pre-release counts as
    the release it leads to (5.25.0.dev0 is 5.25.0)."""
    release = _release(transformers.__version__ if version is None else version)
    oldest, newest = (_release(v) for v in TESTED_TRANSFORMERS)
    return oldest <= release <= newest


_warned_untested = False


def warn_if_untested() -> bool:
    """Warns once per process when the installed transformers lies outside the tested range; returns whether it
    does."""
    global _warned_untested
    if in_tested_range():
        return False
    if not _warned_untested:
        _warned_untested = True
        warnings.warn(
            f"hf_tiny was tested with transformers {tested_range_text()}; transformers {transformers.__version__} is "
            "installed. Models check their cached generation once before generating; if a result looks wrong, "
            f"install a tested version (pip install 'transformers{tested_range_text()}')",
            UserWarning,
            stacklevel=3,
        )
    return True


# ---- the one-time generation check outside the tested range -------------------------------------------------------

_checked_classes: dict = {}


def check_cached_generation(model) -> None:
    """Outside the tested range, once per model class and process: greedy-decodes two tokens of a short prompt with
    and without the cache and raises when they disagree (a renamed generation argument leaves the cache unused)."""
    if not warn_if_untested():
        return
    key = type(model)
    if key in _checked_classes:
        if _checked_classes[key] is not None:
            raise _checked_classes[key]
        return
    _checked_classes[key] = None  # the check's own generate() calls come back here: let them through
    try:
        error = _cached_generation_error(model)
    except Exception as failure:  # generation itself breaks with this transformers
        error = RuntimeError(
            f"{type(model).__name__}: with transformers {transformers.__version__} (hf_tiny is tested with "
            f"{tested_range_text()}) a two-token greedy generation fails ({type(failure).__name__}: {failure}). "
            f"Install a tested version: pip install 'transformers{tested_range_text()}'"
        )
        error.__cause__ = failure
    _checked_classes[key] = error
    if error is not None:
        raise error


@torch.no_grad()
def _cached_generation_error(model) -> Optional[RuntimeError]:
    vocab = model.config.vocab_size
    prompt = (torch.arange(5, device=model.device) * 7 + 3) % vocab
    runs = []
    for use_cache in (False, True):
        out = model.generate(
            prompt[None], max_new_tokens=2, min_new_tokens=2, do_sample=False, num_beams=1, use_cache=use_cache,
            return_dict_in_generate=True, output_logits=True, pad_token_id=0, eos_token_id=None,
        )
        runs.append(torch.stack(out.logits).float())
    uncached, cached = runs
    scale = uncached.abs().max().clamp(min=1e-6)
    difference = float((cached - uncached).abs().max() / scale)
    if difference <= 1e-2 and torch.equal(cached.argmax(-1), uncached.argmax(-1)):
        return None
    return RuntimeError(
        f"{type(model).__name__}: with transformers {transformers.__version__} (hf_tiny is tested with "
        f"{tested_range_text()}) cached generation does not match uncached generation (relative logit difference "
        f"{difference:.3g}): this transformers passes generation's arguments differently. Install a tested version: "
        f"pip install 'transformers{tested_range_text()}'"
    )


# ---- activation checkpointing's two names --------------------------------------------------------------------------
# transformers 5.24 renamed gradient checkpointing to activation checkpointing (model methods and the
# TrainingArguments field); the old names warn there and the new ones do not exist before.


def enable_activation_checkpointing(model, checkpointing_kwargs: Optional[dict] = None) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(checkpointing_kwargs)


def disable_activation_checkpointing(model) -> None:
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    disable()


def is_activation_checkpointing(model) -> bool:
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def checkpointing_training_argument(arguments_class, enabled: bool) -> dict:
    """The keyword of TrainingArguments (or a subclass: TRL's configs) that turns activation checkpointing on, under
    this transformers' name."""
    fields = arguments_class.__dataclass_fields__
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {name: enabled}

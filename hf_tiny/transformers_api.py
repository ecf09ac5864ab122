"""The parts of transformers' contract that differ across the versions hf_tiny supports, each read in one place.

- The tested ranges (TESTED_TRANSFORMERS, TESTED_TORCH): the version-sensitive part of the suite passes on both ends
  of each (.ci/run). Outside either range hf_tiny warns once per process, naming the installed and the tested
  versions. Outside the transformers range, before a model class first generates, it also checks that cached greedy
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

# Oldest and newest releases the version-sensitive tests passed on (CI runs both ends of each). Change a range here,
# in pyproject.toml and in the README together, after those tests pass on the new end.
TESTED_TRANSFORMERS = ("5.16.1", "5.24.0")
TESTED_TORCH = ("2.10.0", "2.15.0")


def _range_text(tested: tuple[str, str]) -> str:
    return f">={tested[0]},<={tested[1]}"


def tested_range_text() -> str:
    return _range_text(TESTED_TRANSFORMERS)


def tested_torch_text() -> str:
    return _range_text(TESTED_TORCH)


def _release(version: str) -> tuple[int, int, int]:
    """The release numbers of a version string: "5.25.0.dev0" -> (5, 25, 0), "5.24" -> (5, 24, 0),
    "2.13.0+cpu" -> (2, 13, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    if match is None:
        raise ValueError(f"not a version number: {version!r}")
    numbers = [int(part) for part in match.group(0).split(".")][:3]
    return tuple(numbers + [0] * (3 - len(numbers)))


def _in_range(version: str, tested: tuple[str, str]) -> bool:
    oldest, newest = (_release(v) for v in tested)
    return oldest <= _release(version) <= newest


def in_tested_range(version: Optional[str] = None) -> bool:
    """Whether `version` (default: the installed transformers) lies in the tested range; a pre-release counts as
    the release it leads to (5.25.0.dev0 is 5.25.0)."""
    return _in_range(transformers.__version__ if version is None else version, TESTED_TRANSFORMERS)


def torch_in_tested_range(version: Optional[str] = None) -> bool:
    """Whether `version` (default: the installed torch) lies in the tested range; a local build tag does not count
    (2.13.0+cpu is 2.13.0) and a pre-release counts as the release it leads to."""
    return _in_range(torch.__version__ if version is None else version, TESTED_TORCH)


_warned_untested: set = set()  # the packages already warned about in this process


def _warn_once(package: str, installed: str, tested: tuple[str, str], advice: str) -> bool:
    """Warns once per process and package when `installed` lies outside `tested`; returns whether it does."""
    if _in_range(installed, tested):
        return False
    if package not in _warned_untested:
        _warned_untested.add(package)
        warnings.warn(
            f"hf_tiny was tested with {package} {_range_text(tested)}; {package} {installed} is installed. {advice}",
            UserWarning,
            stacklevel=4,
        )
    return True


def warn_if_untested() -> bool:
    """Warns once per process when the installed transformers lies outside the tested range; returns whether it
    does."""
    return _warn_once(
        "transformers", transformers.__version__, TESTED_TRANSFORMERS,
        "Models check their cached generation once before generating; if a result looks wrong, install a tested "
        f"version (pip install 'transformers{tested_range_text()}')",
    )


def warn_if_torch_untested() -> bool:
    """Warns once per process when the installed torch lies outside the tested range (every model's post_init asks);
    returns whether it does."""
    return _warn_once(
        "torch", torch.__version__, TESTED_TORCH,
        f"If a result looks wrong, install a tested version (pip install 'torch{tested_torch_text()}')",
    )


# ---- attention names the releases read differently -------------------------------------------------------------------

def without_retired_paged_prefix(name: str) -> str:
    """`paged|sdpa`, `paged|flash_attention_2`, ...: names of their own in older transformers; later ones keep only
    `paged|eager` and read the others without the prefix (with a FutureWarning), which their continuous batching
    expects. As the installed transformers reads the name: unchanged where it still registers it."""
    from transformers import AttentionInterface

    if not name.startswith("paged|") or name == "paged|eager" or name in AttentionInterface():
        return name
    warnings.warn(f"attn_implementation={name!r}: the `paged|` prefix is no longer needed with transformers "
                  f"{transformers.__version__} (except for paged|eager); using {name.removeprefix('paged|')!r}",
                  FutureWarning, stacklevel=3)
    return name.removeprefix("paged|")


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


def deepseek_router_float32() -> list[str]:
    """What DeepSeek-V3's official router keeps float32 in a bf16 / fp16 model (DeepseekV3PreTrainedModel's
    _keep_in_fp32_modules_strict; our names are official's). The list grew: 5.16 keeps the correction bias, 5.24 the
    router's weight too, and from then on official's router also creates both in float32, which disk offload reads
    (it restores an offloaded tensor in the dtype its parameter was created in)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3PreTrainedModel

    return list(DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict or ())


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

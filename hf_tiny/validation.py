"""Checks shared by configs and forwards. Every error names the field and the value it got."""

from __future__ import annotations

import inspect
import math
from typing import Callable, Iterable, Optional

import torch
from transformers.utils import logging

logger = logging.get_logger("hf_tiny")


def is_compiling() -> bool:
    """True while torch.compile traces: data-dependent checks and branches are skipped then."""
    return torch.compiler.is_compiling()


def check_positive(owner: str, **fields) -> None:
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


def check_positive_number(owner: str, **fields) -> None:
    """Finite numbers > 0 (norm epsilons, init ranges); NaN and inf are refused."""
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{owner}: {name} must be a positive number, got {value!r}")


def check_non_negative_number(owner: str, **fields) -> None:
    """Numbers >= 0 (loss weights; 0 turns the term off)."""
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{owner}: {name} must be a number >= 0, got {value!r}")


def _non_finite(value, path: str):
    """(path, value) of the first NaN / inf float inside value (nested dicts and lists), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    if isinstance(value, dict):
        items = ((f"{path}[{key!r}]", item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    for item_path, item in items:
        found = _non_finite(item, item_path)
        if found is not None:
            return found
    return None


def check_finite_fields(owner: str, fields: dict) -> None:
    """No float field of a config (nested in dicts such as rope_parameters too) may be NaN or inf: such a value
    would pass `value > 0`-style checks by accident or slip through unchecked, and give all-NaN outputs."""
    for name, value in fields.items():
        found = _non_finite(value, name)
        if found is not None:
            raise ValueError(f"{owner}: {found[0]} must be a finite number, got {found[1]!r}")


def check_non_negative(owner: str, hint: str = "", **fields) -> None:
    """Integers >= 0 (hint: what 0 means, for the message)."""
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            meaning = f" ({hint})" if hint else ""
            raise ValueError(f"{owner}: {name} must be an integer >= 0{meaning}, got {value!r}")


def check_bool(owner: str, **fields) -> None:
    for name, value in fields.items():
        if not isinstance(value, bool):
            raise TypeError(f"{owner}: {name} must be True or False, got {value!r}")


def check_token_ids(owner: str, vocab_size: int, **token_ids) -> None:
    """Special token ids that index the embeddings (pad, decoder start): None or an id in [0, vocab_size)."""
    for name, value in token_ids.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size):
            raise ValueError(f"{owner}: {name} must be None or a token id in [0, {vocab_size}), got {value!r}")


def warn_on_token_ids_outside(owner: str, vocab_size: int, **token_ids) -> None:
    """Special token ids the model never looks up (bos, eos): accepted outside the vocabulary with official
    transformers' warning (GPT-2 configs keep 50256 with any vocabulary), refused when they are not integers
    (or lists of integers, eos)."""
    for name, value in token_ids.items():
        values = value if name == "eos_token_id" and isinstance(value, (list, tuple)) else [value]
        for item in values:
            if item is None:
                continue
            if isinstance(item, bool) or not isinstance(item, int):
                raise ValueError(f"{owner}: {name} must be None or an integer token id, got {value!r}")
            if not 0 <= item < vocab_size:
                logger.warning_once(
                    f"Model config: {name} must be `None` or an integer within the vocabulary (between 0 and "
                    f"{vocab_size - 1}), got {item}. This may result in unexpected behavior."
                )


def store_init_fields(config, init: Callable, arguments: dict, skip: Iterable[str] = ()) -> None:
    """Sets every named parameter of the config's `init` from `arguments` (its locals() once defaults are
    resolved), so a config's field list is written once: in its signature. `skip`: fields of mechanisms this
    config does not use, which it then does not hold at all."""
    skip = set(skip)
    for name in inspect.signature(init).parameters:
        if name not in ("self", "kwargs") and name not in skip:
            setattr(config, name, arguments[name])


def init_arguments(arguments: dict) -> dict:
    """A config __init__'s arguments from its locals(): the named ones and those in **kwargs, by field name."""
    fields = {k: v for k, v in arguments.items() if k not in ("self", "kwargs", "__class__")}
    return {**fields, **arguments.get("kwargs", {})}


def check_probability(owner: str, **fields) -> None:
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ValueError(f"{owner}: {name} must be a float in [0, 1), got {value!r}")


def check_divisible(owner: str, numerator_name: str, numerator: int, denominator_name: str, denominator: int) -> None:
    if numerator % denominator != 0:
        raise ValueError(
            f"{owner}: {numerator_name} ({numerator}) must be divisible by {denominator_name} ({denominator})"
        )


def check_choice(owner: str, field: str, value, choices: Iterable) -> None:
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{owner}: unknown {field} {value!r}; choose one of {choices}")


def check_labels(
    labels,
    *,
    num_classes: int,
    expected_shape: Optional[tuple] = None,
    field: str = "labels",
    ignore_index: int = -100,
) -> None:
    """Class-index labels (token ids, tags, classes): an integer tensor, of expected_shape when given, whose values
    are in [0, num_classes) or ignore_index (a position the loss skips)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{field} must be a torch.Tensor of class ids, got {type(labels).__name__}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"{field} must hold integer class ids, got dtype {labels.dtype}")
    if expected_shape is not None and tuple(labels.shape) != tuple(expected_shape):
        raise ValueError(f"{field} has shape {tuple(labels.shape)} but the input needs {tuple(expected_shape)}")
    if labels.numel() == 0 or is_compiling():
        return
    invalid = (labels != ignore_index) & ((labels < 0) | (labels >= num_classes))
    if bool(invalid.any()):
        raise ValueError(
            f"{field} contains {labels[invalid][0].item()}, outside [0, {num_classes}) "
            f"(use {ignore_index} for positions the loss should ignore)"
        )


def sequence_problem_type(problem_type: Optional[str], num_labels: int, labels: torch.Tensor) -> str:
    """transformers' choice of sequence-classification loss when config.problem_type is unset."""
    if problem_type is not None:
        return problem_type
    if num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def check_sequence_labels(labels, *, problem_type: Optional[str], batch_size: int, num_labels: int) -> None:
    """Labels of a sequence-classification head for its problem type (see sequence_problem_type):
    single-label: class ids [batch] (or [batch, 1]); regression: [batch] or [batch, num_labels] numbers;
    multi-label: [batch, num_labels] 0/1 targets."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    kind = sequence_problem_type(problem_type, num_labels, labels)
    shape = tuple(labels.shape)
    if kind == "single_label_classification":
        if shape not in ((batch_size,), (batch_size, 1)):
            raise ValueError(f"labels has shape {shape} but single-label classification needs ({batch_size},)")
        check_labels(labels, num_classes=num_labels)
        return
    if labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must hold numbers for {kind}, got dtype {labels.dtype}")
    allowed = [(batch_size, num_labels)]
    if kind == "regression" and num_labels == 1:
        allowed = [(batch_size,), (batch_size, 1)]
    if shape not in allowed:
        raise ValueError(f"labels has shape {shape} but {kind} needs {' or '.join(map(str, allowed))}")


def check_answer_positions(positions, *, batch_size: int, field: str) -> None:
    """Extractive-QA start/end token indices: integers, one per example (values past the input are allowed: the
    loss ignores them, as BERT does)."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{field} must be a torch.Tensor of token indices, got {type(positions).__name__}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"{field} must hold integer token indices, got dtype {positions.dtype}")
    if positions.numel() != batch_size:
        raise ValueError(f"{field} has shape {tuple(positions.shape)} but the batch needs one index per example ({batch_size},)")


def check_unsupported_field(owner: str, kwargs: dict, field: str, allowed: tuple, hint: str) -> None:
    """A field this family does not implement, arriving through a config's **kwargs (where transformers would
    store it silently): it must be absent or one of `allowed`, so a variant the model cannot run (relative
    positions in an absolute-position encoder, RoPE scaling in a model without RoPE) is an error, not ignored."""
    if field in kwargs and kwargs[field] not in allowed:
        raise ValueError(f"{owner}: {field}={kwargs[field]!r} is not supported; {hint}")

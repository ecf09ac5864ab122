"""Key maps: declarative, strict, reversible maps between a checkpoint's tensor names and hf_tiny's.

A family states its map as Rules ("official key template" -> "hf_tiny key template", optionally through a
named Transform); KeyMap.to_target / to_source apply it in either direction and refuse anything unmapped.
"""

from __future__ import annotations

import itertools
import re
import string
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import ConversionError, list_names, raise_problems

@dataclass(frozen=True)
class Transform:
    """A named pair of inverse tensor functions applied by a rule.

    forward(*source_tensors) -> target tensor, or a tuple with one tensor per target key;
    backward(*target_tensors) -> source tensor, or a tuple with one tensor per source key.
    backward(forward(x)) must equal x bit-exactly (the round-trip tests check it).
    """

    name: str
    forward: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    backward: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Rule:
    """Maps source key(s) to target key(s); templates may use placeholders like {i} (a layer index).

    Without a transform, either side may hold several keys: they are tied copies of one tensor (several sources
    must be bit-equal; every target gets the tensor).
    optional=True: the rule is skipped when none of its input keys is present in any layer (e.g. a bias some
    checkpoints lack); present in some layers only, the missing ones are an error.
    """

    source: str | tuple[str, ...]
    target: str | tuple[str, ...]
    transform: Transform | None = None
    optional: bool = False

    def __post_init__(self):
        for side in ("source", "target"):
            value = getattr(self, side)
            keys = (value,) if isinstance(value, str) else tuple(value)
            if not keys or not all(isinstance(k, str) and k for k in keys):
                raise ValueError(f"Rule.{side} must be a non-empty key or tuple of keys, got {value!r}")
            object.__setattr__(self, side, keys)
        if self.transform is not None and not isinstance(self.transform, Transform):
            raise TypeError(f"Rule.transform must be a Transform, got {type(self.transform).__name__}")
        placeholders = _placeholders(self.source + self.target)
        for side in (self.source, self.target):
            for key in side:
                if _placeholders((key,)) != placeholders:
                    raise ValueError(
                        f"every key of a rule must use the same placeholders {sorted(placeholders)}; {key!r} does not"
                    )


_FORMATTER = string.Formatter()


def _placeholders(templates: Iterable[str]) -> set[str]:
    return {field for template in templates for _, field, _, _ in _FORMATTER.parse(template) if field is not None}


def _as_rule(rule) -> Rule:
    if isinstance(rule, Rule):
        return rule
    if isinstance(rule, (tuple, list)) and len(rule) in (2, 3):
        return Rule(*rule)
    raise TypeError(f"a KeyMap rule is a Rule or a (source, target[, transform]) tuple, got {rule!r}")


@dataclass(frozen=True)
class _ConcreteRule:
    source: tuple[str, ...]
    target: tuple[str, ...]
    transform: Transform | None
    optional: bool
    origin: int  # index of the Rule it was expanded from


class KeyMap:
    """A declarative, strict, reversible map between a source checkpoint naming and the hf_tiny naming.

    rules: Rule objects or (source, target[, transform]) tuples. Placeholders ({i}, {j}, ...) range over
    `num_layers` (an int for every placeholder, or a mapping {placeholder: count}).
    ignore: regexes (full match) of source keys that are dropped on purpose (e.g. position_ids buffers).
    ignore_target: regexes of hf_tiny keys dropped on purpose when mapping back.
    """

    def __init__(self, rules: Iterable, *, ignore: Iterable[str] = (), ignore_target: Iterable[str] = ()):
        self.rules: tuple[Rule, ...] = tuple(_as_rule(rule) for rule in rules)
        if not self.rules:
            raise ValueError("a KeyMap needs at least one rule")
        self.ignore = tuple(re.compile(pattern) for pattern in ignore)
        self.ignore_target = tuple(re.compile(pattern) for pattern in ignore_target)
        self.placeholders = _placeholders(k for rule in self.rules for k in rule.source + rule.target)

    def __repr__(self) -> str:
        return f"KeyMap({len(self.rules)} rules, ignore={[p.pattern for p in self.ignore]})"

    def _expand(self, num_layers: int | Mapping[str, int]) -> list[_ConcreteRule]:
        if isinstance(num_layers, Mapping):
            counts = dict(num_layers)
        else:
            counts = {name: num_layers for name in self.placeholders}
        for name in self.placeholders:
            count = counts.get(name)
            if count is None:
                raise ValueError(f"num_layers gives no count for placeholder {{{name}}}: {num_layers!r}")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"num_layers[{name!r}] must be an int >= 0, got {count!r}")
        concrete = []
        for origin, rule in enumerate(self.rules):
            names = sorted(_placeholders(rule.source + rule.target))
            for values in itertools.product(*(range(counts[n]) for n in names)):
                fill = dict(zip(names, values, strict=True))
                concrete.append(
                    _ConcreteRule(
                        tuple(k.format(**fill) for k in rule.source),
                        tuple(k.format(**fill) for k in rule.target),
                        rule.transform,
                        rule.optional,
                        origin,
                    )
                )
        for side in ("source", "target"):
            seen: dict[str, int] = {}
            for rule in concrete:
                for key in getattr(rule, side):
                    seen[key] = seen.get(key, 0) + 1
            duplicated = [k for k, n in seen.items() if n > 1]
            if duplicated:
                raise ValueError(f"KeyMap rules name these {side} keys more than once: {list_names(duplicated)}")
        return concrete

    def source_keys(self, num_layers: int | Mapping[str, int]) -> list[str]:
        return [key for rule in self._expand(num_layers) for key in rule.source]

    def target_keys(self, num_layers: int | Mapping[str, int]) -> list[str]:
        return [key for rule in self._expand(num_layers) for key in rule.target]

    def to_target(
        self, state_dict: Mapping[str, torch.Tensor], *, num_layers: int | Mapping[str, int], progress: bool = False
    ) -> dict[str, torch.Tensor]:
        """Source naming -> hf_tiny naming; every source tensor is used or ignored, every rule is satisfied."""
        return dict(self.iterate(state_dict, num_layers=num_layers, forward=True, progress=progress))

    def to_source(
        self, state_dict: Mapping[str, torch.Tensor], *, num_layers: int | Mapping[str, int], progress: bool = False
    ) -> dict[str, torch.Tensor]:
        """hf_tiny naming -> source naming; the exact inverse of to_target (minus ignored keys)."""
        return dict(self.iterate(state_dict, num_layers=num_layers, forward=False, progress=progress))

    def steps(self, keys: Iterable[str], *, num_layers, forward: bool = True) -> list[MapStep]:
        """What mapping a state with these keys runs, one step per concrete rule; checked before any tensor is
        read: every input present, every key used or ignored."""
        keys = set(keys)
        rules = self._expand(num_layers)
        ignore = self.ignore if forward else self.ignore_target
        direction = "source" if forward else "hf_tiny"
        # An optional rule is all-or-nothing over its layers: absent everywhere -> skipped, else required.
        present_origins = {
            rule.origin for rule in rules if any(key in keys for key in (rule.source if forward else rule.target))
        }
        missing, used, steps = [], set(), []
        for rule in rules:
            if rule.optional and rule.origin not in present_origins:
                continue
            inputs, outputs = (rule.source, rule.target) if forward else (rule.target, rule.source)
            missing.extend(key for key in inputs if key not in keys)
            used.update(inputs)
            function = None
            if rule.transform is not None:
                function = rule.transform.forward if forward else rule.transform.backward
            steps.append(MapStep(inputs, outputs, function, rule.transform.name if rule.transform else None))
        unknown = [k for k in keys if k not in used and not any(p.fullmatch(k) for p in ignore)]
        raise_problems({
            f"missing {direction} tensors": list_names(missing),
            f"unexpected {direction} tensors (not mapped, not ignored)": list_names(unknown),
        })
        return steps

    def iterate(self, state_dict: Mapping[str, torch.Tensor], *, num_layers, forward: bool = True,
                progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor) of the mapped state, one rule at a time: a lazy state_dict (lazy.py) is read one rule's
        tensors at a time, so the whole state is never in memory at once."""
        from tqdm.auto import tqdm

        steps = self.steps(state_dict.keys(), num_layers=num_layers, forward=forward)
        for step in tqdm(steps, desc="mapping tensors", unit="rule", disable=not progress, file=sys.stderr, leave=False):
            yield from zip(step.outputs, step.run([state_dict[key] for key in step.inputs]), strict=True)


    def lazy_view(self, state, *, num_layers, forward: bool = True):
        """The mapped state as lazy.LazyTensors: nothing is read or computed until a key is asked for, then only
        that key's rule (the last rule's outputs are kept, so reading a rule's several outputs in a row runs it
        once)."""
        from .lazy import LazyTensors

        steps = self.steps(state.keys(), num_layers=num_layers, forward=forward)
        infos, step_of = {}, {}
        for step in steps:
            for key, info in zip(step.outputs, step.output_infos(state), strict=True):
                infos[key], step_of[key] = info, step
        last: dict = {}

        def read(key: str) -> torch.Tensor:
            step = step_of[key]
            if last.get("step") is not step:
                last.clear()
                last.update(step=step, outputs=dict(zip(step.outputs, step.run([state[k] for k in step.inputs]))))
            return last["outputs"][key]

        return LazyTensors(infos, read)


@dataclass(frozen=True)
class MapStep:
    """One concrete rule in one direction: inputs -> outputs through function (None: copies of one tensor)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    function: Callable | None
    transform_name: str | None

    def output_infos(self, state, expected: Mapping[str, torch.Size] | None = None) -> list:
        """The outputs' TensorInfos from the inputs' (state.info) alone: the transform run on meta tensors; one
        that cannot run there gets the expected shape (else its first input's) and its first input's dtype."""
        from .lazy import TensorInfo

        inputs = [state.info(key).meta() for key in self.inputs]
        try:
            outputs = self.run(inputs) if self.function is not None else (inputs[0],) * len(self.outputs)
            return [TensorInfo(tuple(t.shape), t.dtype) for t in outputs]
        except ConversionError:
            shape = lambda key: tuple((expected or {}).get(key, inputs[0].shape))  # noqa: E731
            return [TensorInfo(shape(key), inputs[0].dtype) for key in self.outputs]

    def run(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.function is None:
            _require_tied(self.inputs, tensors)
            return (tensors[0],) * len(self.outputs)
        try:
            produced = self.function(*tensors)
        except Exception as error:  # a transform failing on a bad tensor is the user's checkpoint
            raise ConversionError(
                f"transform {self.transform_name!r} failed on {', '.join(self.inputs)}: {type(error).__name__}: {error}"
            ) from error
        produced = (produced,) if isinstance(produced, torch.Tensor) else tuple(produced)
        if len(produced) != len(self.outputs):
            raise ConversionError(
                f"transform {self.transform_name!r} returned {len(produced)} tensors for {len(self.outputs)} keys "
                f"{', '.join(self.outputs)}"
            )
        return produced


def _require_tied(keys: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    first = tensors[0]
    for key, tensor in zip(keys[1:], tensors[1:], strict=True):
        if tensor.shape != first.shape or tensor.dtype != first.dtype or not torch.equal(tensor, first):
            raise ConversionError(
                f"tensors {keys[0]} and {key} should be tied (identical) copies but differ"
            )


def check_shapes(state_dict: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size]) -> None:
    """Raises one ConversionError naming every missing, unexpected and wrong-shape key."""
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    wrong = [
        f"{k} (expected {tuple(expected[k])}, got {tuple(state_dict[k].shape)})"
        for k in expected
        if k in state_dict and tuple(state_dict[k].shape) != tuple(expected[k])
    ]
    # hf_tiny models hold floating tensors only: an integer or bool weight is a corrupt or foreign checkpoint
    not_floating = [
        f"{k} ({str(state_dict[k].dtype).removeprefix('torch.')})"
        for k in expected
        if k in state_dict and not state_dict[k].is_floating_point()
    ]
    raise_problems({
        "tensors that must hold floating-point weights": list_names(not_floating),
        "wrong shapes": ", ".join(sorted(wrong)),
        "missing tensors": list_names(missing),
        "unexpected tensors": list_names(unexpected),
    })


def expected_shapes(module: torch.nn.Module) -> dict[str, torch.Size]:
    """{name: shape} of a module's state dict; build the module on the meta device to make this free."""
    return {name: tensor.shape for name, tensor in module.state_dict().items()}


def join(prefix: str, name: str) -> str:
    """prefix.name, or name alone when the prefix is empty (a bare model's tensors have none)."""
    return f"{prefix}.{name}" if prefix else name


def layer_rules(source_prefix: str, target_prefix: str, modules: Mapping[str, str], params=("weight", "bias")) -> list:
    """(source, target) rules for every module of a table (official name -> hf_tiny name) and each parameter."""
    return [
        (join(source_prefix, f"{s}.{p}"), join(target_prefix, f"{t}.{p}")) for s, t in modules.items() for p in params
    ]

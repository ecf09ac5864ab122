"""The interface of an official model type the llama family converts: what it changes in the Llama block, as one
table with every hook and its default (Llama's). Each type's module fills in only what differs (smollm3.py,
olmo2.py, llama4.py, gpt_oss.py, deepseek.py, moe.py, dense.py); llama_configs.OFFICIAL_TYPES lists them all.

    forward   fields_from_official  the official config -> TinyCausalConfig's fields beyond causal.SHARED_FIELDS
    back      claims, check_holds   which type an hf_tiny config goes back to, and what the official class refuses
              official_fields       TinyCausalConfig -> the official config's fields beyond SHARED_FIELDS
    both      renamed_fields        shared fields the official config names otherwise
              layer_norms, adapt_layer_rules, sparse_rules   the key map of one layer
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from .errors import ConversionError

# Llama's two norms per layer, named alike on both sides (ours: the attention's and the MLP's pre-norm)
LLAMA_NORMS = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm"}


def every_nth(derive: Callable[[int], list], given: list, layers: int, default: int) -> int:
    """The interval n (1..layers) official derives `given` from as derive(n), else official's default: a folder
    written back then reads as its source did (the list, written beside it, is what official builds)."""
    return next((n for n in range(1, layers + 1) if derive(n) == given), default)


def no_rope_fields(nope_layers, layers: int) -> dict:
    """SmolLM3's and Llama 4's no_rope_layers (1 where the layer rotates) and the no_rope_layer_interval they follow."""
    nope = set(nope_layers)
    flags = [0 if i in nope else 1 for i in range(layers)]
    interval = every_nth(lambda n: [int((i + 1) % n != 0) for i in range(layers)], flags, layers, default=4)
    return {"no_rope_layers": flags, "no_rope_layer_interval": interval}


def llama_named_classes(prefix: str) -> dict[str, str]:
    """hf_tiny class -> the official class, for a type whose classes follow Llama's names (`<prefix>ForCausalLM`)."""
    return {
        "TinyCausalForCausalLM": f"{prefix}ForCausalLM",
        "TinyCausalForSequenceClassification": f"{prefix}ForSequenceClassification",
        "TinyCausalModel": f"{prefix}Model",
    }


def _no_fields_from_official(official, *, src) -> dict:
    return {}


def _no_official_fields(config) -> dict:
    return {}


def _holds_every_config(config) -> None:
    return None


def _same_rules(config, layer: str, rules: list) -> list:
    return rules


@dataclass(frozen=True)
class CausalVariant:
    """One official model type: its names, and how it differs from the Llama block. A hook left out is Llama's."""

    model_type: str  # config.json's model_type
    config_class: str  # the transformers config class
    official_classes: Mapping[str, str]  # hf_tiny class -> the official class

    # (official config, *, src) -> TinyCausalConfig fields beyond causal.SHARED_FIELDS and the common ones
    # (hidden_act, head_dim, rope_parameters, sliding_window, layer_types; llama_configs.causal_config_from_official)
    fields_from_official: Callable[..., dict] = _no_fields_from_official
    # (hf_tiny config) -> the official config's fields beyond SHARED_FIELDS, hidden_act and rope_parameters
    official_fields: Callable[[Any], dict] = _no_official_fields
    # our name -> the official config's, for the shared fields it names otherwise (Gemma: hidden_activation)
    renamed_fields: Mapping[str, str] = field(default_factory=dict)

    # (hf_tiny config) -> whether it goes back to this type; asked in llama_configs.CLAIMING order, before the MoE
    # and dense rules. None: the type is picked by those rules (moe.official_moe_family, dense.dense_family).
    claims: Optional[Callable[[Any], bool]] = None
    # (hf_tiny config) -> None, or a ConversionError naming what the official class cannot hold (once claimed)
    check_holds: Callable[[Any], None] = _holds_every_config

    # official layer norm name -> ours, in every layer
    layer_norms: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_NORMS))
    # (hf_tiny config, layer prefix, the layer's rules under Llama's names) -> the rules under this type's names
    adapt_layer_rules: Callable[[Any, str, list], list] = _same_rules
    # (hf_tiny config, concrete layer prefix) -> the rules of a sparse (MoE) layer; None: the type has none
    sparse_rules: Optional[Callable[[Any, str], list]] = None

    def sparse_layer_rules(self, config, layer: str) -> list:
        if self.sparse_rules is None:
            raise ConversionError(f"{self.model_type} has no Mixture-of-Experts layers")
        return self.sparse_rules(config, layer)

    def official_class(self, our_class: str, *, src) -> str:
        """The official class of an hf_tiny class, or an error naming the ones this type has."""
        if our_class not in self.official_classes:
            raise ConversionError(f"{src}: {self.model_type} has no counterpart of {our_class}; it has "
                                  f"{', '.join(self.official_classes.values())}")
        return self.official_classes[our_class]

"""Forward plumbing every family shares, written once: the output flags with their config defaults, the one check
of token inputs (exactly one of ids / embeddings, each validated), the collection of per-layer hidden states and
attention weights, and the tuple form of an output.

A plain helper rather than transformers' output-capturing decorators: those hook modules by class and would
change what `output_attentions` returns for the cross-attention of the seq2seq decoder, and our checks must run
before anything is computed (a bad input is an error naming the field, not a shape error deep inside).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from transformers.utils import ModelOutput

from .validation import check_input_ids, check_inputs_embeds


@dataclass(frozen=True)
class OutputFlags:
    attentions: bool
    hidden_states: bool
    return_dict: bool


def output_flags(config, output_attentions=None, output_hidden_states=None, return_dict=None) -> OutputFlags:
    """The caller's choices, or the config's defaults where they are None. Attention weights exist only in the
    'eager' backend: asking for them with another is an error that says how to switch."""
    flags = OutputFlags(
        attentions=bool(config.output_attentions if output_attentions is None else output_attentions),
        hidden_states=bool(config.output_hidden_states if output_hidden_states is None else output_hidden_states),
        return_dict=bool(config.return_dict if return_dict is None else return_dict),
    )
    if flags.attentions and config._attn_implementation != "eager":
        raise ValueError(
            f"output_attentions=True needs the attention weights, which attn_implementation="
            f"{config._attn_implementation!r} does not compute; load the model with attn_implementation='eager' "
            "or call model.set_attn_implementation('eager') first"
        )
    return flags


def check_token_inputs(
    config, input_ids: Optional[torch.Tensor], inputs_embeds: Optional[torch.Tensor], *,
    names: tuple[str, str] = ("input_ids", "inputs_embeds"),
) -> tuple[int, int]:
    """Exactly one of ids / embeddings, checked (ids: integer, in the vocabulary; embeddings: floating, [batch, seq,
    hidden_size]); returns (batch, seq_len)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(f"pass exactly one of {names[0]} or {names[1]}")
    if input_ids is not None:
        check_input_ids(input_ids, vocab_size=config.vocab_size, field=names[0])
        return tuple(input_ids.shape[:2])
    check_inputs_embeds(inputs_embeds, hidden_size=config.hidden_size, field=names[1])
    return tuple(inputs_embeds.shape[:2])


class LayerOutputs:
    """Collects what output_hidden_states / output_attentions ask for while a stack runs (None when not asked)."""

    def __init__(self, flags: OutputFlags, *, cross_attentions: bool = False):
        self.hidden_states = () if flags.hidden_states else None
        self.attentions = () if flags.attentions else None
        self.cross_attentions = () if flags.attentions and cross_attentions else None

    def add_hidden(self, hidden_states: torch.Tensor) -> None:
        if self.hidden_states is not None:
            self.hidden_states += (hidden_states,)

    def add_attentions(self, weights, cross_weights=None) -> None:
        if self.attentions is not None:
            self.attentions += (weights,)
        if self.cross_attentions is not None:
            self.cross_attentions += (cross_weights,)


def format_output(output: ModelOutput, flags_or_return_dict: Union[OutputFlags, bool]) -> Union[ModelOutput, tuple]:
    """The output as a ModelOutput, or as a tuple (None fields dropped) when return_dict is False."""
    return_dict = flags_or_return_dict.return_dict if isinstance(flags_or_return_dict, OutputFlags) else flags_or_return_dict
    return output if return_dict else output.to_tuple()

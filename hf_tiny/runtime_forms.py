"""The runtime's forms of declared forwards.

In place (runtime.py's "in place" path): a layer's forward with each residual sum written into its sublayer's fresh
output, and a feed-forward's with its activation and gated product written into its first projection's output (in the
workspace the layers of one forward share). A + b and b + a are the same IEEE result, and the same kernels run on the
same operands, so each form gives its forward's output bit for bit (tests/runtime/test_runtime.py proves it for every
family). A layer's declaration names its form (`@runtime_layer(in_place="pre_norm_in_place")`, IN_PLACE_LAYERS).

Few rows (runtime.py's "few rows" path): a feed-forward's forward in a decoding step, each of its products through
runtime.few_rows_product (FEW_ROWS_FEED_FORWARDS).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import activations

from .layers import Attention, FeedForward, GatedFeedForward, RMSNorm, down_input
from .runtime import (
    MAX_FEW_ROWS, few_rows_product, in_place_scale, plain_linear, rebuilt_in_backward, untouched, workspace_tensor,
)


def pre_norm_in_place(layer, hidden_states, attention_mask=None, position_embeddings=None, **attention_kwargs):
    """layers.PreNormResidual.forward with each residual sum written into its sublayer's fresh output."""
    normed = hidden_states if layer.input_layernorm is None else layer.input_layernorm(hidden_states)
    attended, _ = layer.self_attn(normed, attention_mask, position_embeddings, **attention_kwargs)
    fresh = _output_is_fresh(layer, layer.attn_output_layernorm, layer.self_attn, "o_proj")
    hidden_states = _add_into(hidden_states, _sublayer_output(layer, attended, layer.attn_output_layernorm), fresh)
    normed = hidden_states if layer.post_attention_layernorm is None else layer.post_attention_layernorm(hidden_states)
    transformed = feed_forward_in_place(layer.mlp, normed)
    fresh = _output_is_fresh(layer, layer.mlp_output_layernorm, layer.mlp, "down_proj")
    return _add_into(hidden_states, _sublayer_output(layer, transformed, layer.mlp_output_layernorm), fresh)


def _sublayer_output(layer, output: torch.Tensor, norm: Optional[nn.Module]) -> torch.Tensor:
    """What PreNormResidual.forward adds to the residual: the output, normed (Gemma 3, OLMo 2) and dropped out."""
    if norm is not None:
        output = norm(output)
    return output if layer.dropout is None else layer.dropout(output)


def post_norm_in_place(layer, hidden_states, attention_mask=None, position_embeddings=None, **attention_kwargs):
    """encoder_layers.TinyEncoderLayer.forward, norm(x + sublayer(x)), each sum written into the sublayer's fresh
    output."""
    attended, _ = layer.self_attn(hidden_states, attention_mask, position_embeddings, **attention_kwargs)
    fresh = _fresh_output(layer.self_attn.o_proj, layer.self_attn, layer.dropout)
    hidden_states = layer.input_layernorm(_add_into(hidden_states, layer.dropout(attended), fresh))
    transformed = feed_forward_in_place(layer.mlp, hidden_states)
    fresh = _fresh_output(getattr(layer.mlp, "down_proj", None), layer.mlp, layer.dropout)
    return layer.post_attention_layernorm(_add_into(hidden_states, layer.dropout(transformed), fresh))


def feed_forward_in_place(feed_forward: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """feed_forward(x), in its in-place form where it has one and may run it; otherwise called as a module."""
    form = _FEED_FORWARDS.get(type(feed_forward))
    stands_in = form is not None and unchanged(feed_forward)
    if not stands_in or not in_place_scale(feed_forward, x):
        return feed_forward(x)
    activate_ = in_place_activation(feed_forward.act_fn)
    projections = (feed_forward.up_proj, feed_forward.down_proj, getattr(feed_forward, "gate_proj", feed_forward.up_proj))
    dropout = feed_forward.dropout
    if activate_ is None or not all(plain_linear(p) and as_defined(p) for p in projections) or not (
            dropout is None or untouched(dropout)):
        return feed_forward(x)
    hidden = form(feed_forward, x, activate_)
    hidden = hidden if dropout is None else dropout(hidden)
    return feed_forward.down_proj(down_input(feed_forward, hidden) if feed_forward.down_in_weight_dtype else hidden)


def _gated(feed_forward: GatedFeedForward, x: torch.Tensor, activate_: Callable) -> torch.Tensor:
    hidden = activate_(_projected(feed_forward.gate_proj, x, "first"))
    up = _projected(feed_forward.up_proj, x, "up")
    return hidden.mul_(up) if _same_layout(hidden, up) else hidden * up


def _plain(feed_forward: FeedForward, x: torch.Tensor, activate_: Callable) -> torch.Tensor:
    return activate_(_projected(feed_forward.up_proj, x, "first"))


# The feed-forwards with an in-place form: what their forward computes before the down projection.
_FEED_FORWARDS = {GatedFeedForward: _gated, FeedForward: _plain}

# The forwards the in-place forms stand in for or rely on, as their classes defined them at import: a class whose
# forward was patched since (a kernel library, activation patching) is called as it is, never stood in for.
_DEFINED_FORWARDS = {cls: cls.forward for cls in (GatedFeedForward, FeedForward, Attention, RMSNorm, nn.LayerNorm,
                                                  nn.Linear, nn.Dropout)}


def as_defined(module: nn.Module) -> bool:
    cls = type(module)
    return cls.forward is _DEFINED_FORWARDS.get(cls, cls.forward)


def unchanged(module: nn.Module) -> bool:
    """untouched (no hook, no forward set on the instance) and its class's forward as defined."""
    return untouched(module) and as_defined(module)


# The layers' in-place forms, by the name their declarations give (`@runtime_layer(in_place=...)`).
IN_PLACE_LAYERS = {"pre_norm_in_place": pre_norm_in_place, "post_norm_in_place": post_norm_in_place}


# ---- few rows: a decoding step's feed-forward with its products weight-first ----------------------------------------


def gated_few_rows(ff: GatedFeedForward, x: torch.Tensor) -> torch.Tensor:
    """GatedFeedForward.forward with each product through few_rows_product (weight-first where it applies)."""
    hidden = ff.act_fn(few_rows_product(ff.gate_proj, x)) * few_rows_product(ff.up_proj, x)
    hidden = hidden if ff.dropout is None else ff.dropout(hidden)
    return few_rows_product(ff.down_proj, down_input(ff, hidden) if ff.down_in_weight_dtype else hidden)


def plain_few_rows(ff: FeedForward, x: torch.Tensor) -> torch.Tensor:
    """FeedForward.forward with each product through few_rows_product."""
    hidden = ff.act_fn(few_rows_product(ff.up_proj, x))
    hidden = hidden if ff.dropout is None else ff.dropout(hidden)
    return few_rows_product(ff.down_proj, down_input(ff, hidden) if ff.down_in_weight_dtype else hidden)


# The few-rows forms, by the feed-forward class whose declared forward they reproduce (runtime_feed_forward looks the
# instance's own class up: a subclass runs its forward as written).
FEW_ROWS_FEED_FORWARDS = {GatedFeedForward: gated_few_rows, FeedForward: plain_few_rows}


# ---- residual sums into fresh outputs ------------------------------------------------------------------------------


def _same_layout(out: torch.Tensor, other: torch.Tensor) -> bool:
    # Broadcasting or type promotion would make the in-place result differ from the out-of-place one.
    return out.shape == other.shape and out.dtype == other.dtype and out.device == other.device


def _add_into(residual: torch.Tensor, out: torch.Tensor, fresh: bool) -> torch.Tensor:
    """residual + out, written into `out` when it is a fresh tensor nothing else holds."""
    return out.add_(residual) if fresh and _same_layout(out, residual) else residual + out


def _fresh_output(last: Optional[nn.Module], *wrappers: Optional[nn.Module]) -> bool:
    """Whether the tensor `wrappers` return is the new output of `last` (a plain projection or norm) that nobody else
    has seen: no hook on any of them (an eval-mode dropout returns its input)."""
    if last is None:
        return False
    plain = (plain_linear(last) or (type(last) in (nn.LayerNorm, RMSNorm) and untouched(last))) and as_defined(last)
    return plain and all(module is None or unchanged(module) for module in wrappers)


def _output_is_fresh(layer: nn.Module, output_norm: Optional[nn.Module], sublayer: nn.Module, last: str) -> bool:
    """Whether _sublayer_output(layer, sublayer's output, output_norm) is fresh: the output norm's new tensor, or (no
    output norm) the sublayer's last projection's."""
    if output_norm is not None:
        return _fresh_output(output_norm, layer.dropout)
    return _fresh_output(getattr(sublayer, last, None), sublayer, layer.dropout)


# ---- products into the workspace -----------------------------------------------------------------------------------


def _linear_into(x: torch.Tensor, linear: nn.Linear, out: torch.Tensor) -> torch.Tensor:
    """linear(x) written into `out` ([rows, out_features]): the addmm / mm F.linear itself runs on more than
    MAX_FEW_ROWS contiguous rows, so the same numbers."""
    flat = x.reshape(-1, x.shape[-1])
    if linear.bias is None:
        torch.mm(flat, linear.weight.t(), out=out)
    else:
        torch.addmm(linear.bias, flat, linear.weight.t(), out=out)
    return out.view(*x.shape[:-1], linear.out_features)


def _projected(linear: nn.Module, x: torch.Tensor, name: str) -> torch.Tensor:
    """linear(x), into the workspace's tensor `name` when one is open and the product is F.linear's own."""
    rows = x.numel() // x.shape[-1]
    weight = linear.weight
    if rows > MAX_FEW_ROWS and x.is_contiguous() and x.dtype == weight.dtype and x.device == weight.device:
        out = workspace_tensor(name, rows, linear.out_features, x)
        if out is not None and not torch.is_autocast_enabled(x.device.type):
            return _linear_into(x, linear, out)
    return linear(x)


# ---- activations in place ------------------------------------------------------------------------------------------


def _gelu_(t: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return torch.ops.aten.gelu_(t, approximate=approximate)


def _exact_classes(*names: str) -> tuple:
    """transformers' activation classes by name (which exist depends on its version), with their forward as defined,
    so a class whose forward was swapped later (a hub kernel) is not mistaken for the torch function."""
    found = (getattr(activations, name, None) for name in names)
    return tuple((cls, cls.forward) for cls in found if cls is not None)


def _is_tanh_gelu(function) -> bool:
    return (isinstance(function, functools.partial) and function.func is F.gelu and not function.args
            and function.keywords == {"approximate": "tanh"})


_IN_PLACE = (
    (_exact_classes("SiLUActivation") + ((nn.SiLU, nn.SiLU.forward),), lambda act: functools.partial(F.silu, inplace=True)),
    (((nn.ReLU, nn.ReLU.forward),), lambda act: functools.partial(F.relu, inplace=True)),
    (_exact_classes("GELUActivation"), lambda act: _gelu_ if getattr(act, "act", None) is F.gelu else None),
    (_exact_classes("GELUTanh", "PytorchGELUTanh"),
     lambda act: functools.partial(_gelu_, approximate="tanh") if _is_tanh_gelu(getattr(act, "act", None)) else None),
    (((nn.GELU, nn.GELU.forward),), lambda act: functools.partial(_gelu_, approximate=act.approximate)),
)


def in_place_activation(act_fn: nn.Module) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The in-place form of `act_fn` when it computes exactly a torch activation and calling it can be skipped; None
    otherwise."""
    if not untouched(act_fn):
        return None
    kind = type(act_fn)
    for classes, make in _IN_PLACE:
        if any(kind is cls and kind.forward is forward for cls, forward in classes):
            return make(act_fn)
    return None


# ---- rebuilt: a feed-forward's product not kept for backward (runtime.rebuilt_in_backward) ---------------------------


def gated_rebuilt(module: GatedFeedForward, x: torch.Tensor) -> torch.Tensor:
    """GatedFeedForward.forward whose product act(gate) * up the down projection does not keep: backward rebuilds it
    from act(gate) and up, which the product's own backward keeps. With activation dropout, the forward as written
    (its mask would have to be kept instead)."""
    if module.dropout is not None:
        return type(module).forward.__wrapped__(module, x)
    activated, up = module.act_fn(module.gate_proj(x)), module.up_proj(x)
    hidden = activated * up
    with rebuilt_in_backward(module, hidden, lambda: activated * up):
        return module.down_proj(down_input(module, hidden) if module.down_in_weight_dtype else hidden)


REBUILT_FEED_FORWARDS = {GatedFeedForward: gated_rebuilt}

"""Liger-Kernel's training kernels on hf_tiny causal models, through the switch the ecosystem already has:
`TrainingArguments(use_liger_kernel=True)` (and TRL's configs, which pass it on) calls Liger's
`_apply_liger_kernel_to_instance(model)`, which looks `config.model_type` up in Liger's table of apply functions
(`liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN`). This file puts "hf_tiny_causal" in that
table, with an apply function that gives a model what Liger gives official Llama, on the model instance:

- RMSNorm -> Liger's RMSNorm kernel (Llama's casting; Gemma's unit offset as Liger's offset=1 with Gemma's casting);
- the gated SiLU feed-forward (dense layers, MoE experts and shared experts) -> LigerSwiGLUMLP's forward, and
  Gemma's tanh-GELU gate -> LigerGEGLUMLP's (as Liger does for Gemma 3);
- RoPE -> liger_rotary_pos_emb, on layers that rotate all of each head with (cos, sin);
- the causal LM loss while training with labels -> Liger's fused linear cross-entropy (LigerForCausalLMLoss), where
  hf_tiny would run its own chunked loss (the logits are not materialised either way).

Only where our module computes what Liger's kernel computes; everything else keeps our modules (LayerNorm, exact-GELU or
clamped gates, feed-forwards with activation dropout, weightless and MLA norms, partial rotary, Llama 4's norm after
RoPE, MTP modules). The apply function returns what it replaced and logs it with what it kept.

Liger is an optional extra (`pip install hf_tiny[gpu]`): nothing here imports it at import time (it costs seconds
and saved folders must load without it). `register_liger_kernels` adds the table entry right after Liger's table
module is imported, however that happens. Where Liger is missing or cannot run (a CPU), the switch fails exactly as
on official Llama: transformers refuses without the package, and Liger's Triton kernels raise on CPU tensors.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
import types
from collections import Counter
from typing import Optional

import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .layers import Attention, GatedFeedForward, RMSNorm
from .runtime import configure as configure_runtime, rebuilds, rebuilt_in_backward

logger = logging.getLogger(__name__)

MODEL_TYPE = "hf_tiny_causal"
LIGER_TABLE_MODULE = "liger_kernel.transformers.monkey_patch"
# The activation classes transformers builds for these names (the class names differ across its releases)
SILU_NAMES = ("silu", "swish")
TANH_GELU_NAME = "gelu_pytorch_tanh"


def apply_liger_kernel_to_hf_tiny(rope: bool = True, cross_entropy: bool = False,
                                  fused_linear_cross_entropy: bool = True, rms_norm: bool = True, swiglu: bool = True,
                                  model=None, geglu: bool = True) -> Counter:
    """Liger's kernels on an hf_tiny causal model instance; the arguments and defaults of Liger's
    apply_liger_kernel_to_llama, and geglu (apply_liger_kernel_to_gemma3_text's) for Gemma's gates. Returns the
    count of what was replaced (rms_norm, swiglu, geglu, rope, fused_linear_cross_entropy)."""
    if cross_entropy and fused_linear_cross_entropy:
        raise ValueError("cross_entropy and fused_linear_cross_entropy cannot both be True (as in Liger-Kernel)")
    if model is None:
        raise ValueError(
            "hf_tiny applies Liger-Kernel's kernels to a model instance (model=...), as Trainer(use_liger_kernel=True) "
            "does; it has no classes to patch before the model exists (AutoLigerKernelForCausalLM): load the model, "
            "then call apply_liger_kernel_to_hf_tiny(model=model)"
        )
    flags = dict(rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
                 rms_norm=rms_norm, swiglu=swiglu, geglu=geglu)
    own_copy = _liger_module_of(model)
    if own_copy is not None and own_copy is not sys.modules[__name__]:  # a remote-code copy of hf_tiny built it
        return own_copy.apply_liger_kernel_to_hf_tiny(model=model, **flags)
    liger = _liger()
    base = getattr(model, model.base_model_prefix, model)
    replaced, kept = Counter(), Counter()
    if rms_norm:
        _patch_norms(base, liger, replaced, kept)
    _patch_feed_forwards(base, liger, flags, replaced, kept)
    if rope:
        replaced["rope"], kept["attention without full RoPE"] = _patch_rotary(base)
    if cross_entropy:  # Liger's own switch: the cross-entropy transformers' losses call, process-wide
        liger.loss_utils_nn.functional.cross_entropy = liger.cross_entropy
    if fused_linear_cross_entropy and hasattr(model, "_chunked_loss"):
        # the head's loss without logits on every device, as Liger computes it for official Llama
        model._chunked_loss = types.MethodType(_liger_causal_lm_loss, model)
        configure_runtime(model, chunked_loss=True)
        replaced["fused_linear_cross_entropy"] += 1
    for layer in base.layers if sum(replaced.values()) else ():
        # The runtime's replay (selective recompute) cannot see inside Liger's kernels, and Liger's RoPE writes q and
        # k in place into the projections' outputs, which the replay keeps: replayed, the layer rotates twice. The
        # layers Liger runs in run their modeling file's forward (gradient checkpointing still works, as on Llama).
        configure_runtime(layer, False)
    logger.info("hf_tiny: Liger-Kernel replaced %s; kept %s", dict(+replaced), dict(+kept))
    return +replaced


@functools.lru_cache(maxsize=None)  # read by every Liger feed-forward of every step
def _liger():
    """The parts of Liger-Kernel this file uses. Imported in a try block: transformers' check of a remote-code
    folder's imports reads function bodies too, and leaves out only try blocks (Liger stays optional)."""
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
        from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss
        from liger_kernel.transformers.monkey_patch import (
            _patch_geglu_module, _patch_rms_norm_module, _patch_swiglu_module,
        )
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
        from transformers.loss.loss_utils import nn as loss_utils_nn
    except ImportError as error:
        raise ImportError(f"hf_tiny's Liger-Kernel path needs liger-kernel (pip install 'hf_tiny[gpu]'): {error}") \
            from error
    return types.SimpleNamespace(
        patch_rms_norm=_patch_rms_norm_module, patch_swiglu=_patch_swiglu_module, patch_geglu=_patch_geglu_module,
        SwiGLUMLP=LigerSwiGLUMLP, rotary_pos_emb=liger_rotary_pos_emb, causal_lm_loss=LigerForCausalLMLoss,
        cross_entropy=liger_cross_entropy, loss_utils_nn=loss_utils_nn, silu_mul=LigerSiLUMulFunction.apply,
    )


def _patch_norms(base, liger, replaced: Counter, kept: Counter) -> None:
    for norm, in_place in _norms(base):
        if _liger_can_norm(norm):
            liger.patch_rms_norm(norm, offset=1.0 if norm.unit_offset else 0.0, eps=norm.variance_epsilon,
                                 casting_mode="gemma" if norm.unit_offset else "llama", in_place=in_place)
            replaced["rms_norm"] += 1
        else:
            kept[type(norm).__name__] += 1


def _patch_feed_forwards(base, liger, flags: dict, replaced: Counter, kept: Counter) -> None:
    for mlp in _feed_forwards(base):
        kind = _gated_kind(mlp)
        if kind is None or not flags[kind]:
            kept[type(mlp).__name__] += 1
            continue
        if kind == "swiglu":
            swiglu = types.SimpleNamespace(forward=_liger_swiglu_forward, __name__=liger.SwiGLUMLP.__name__)
            liger.patch_swiglu(mlp, swiglu)
        else:
            liger.patch_geglu(mlp)
        replaced[kind] += 1


def _liger_swiglu_forward(self, x):
    """LigerSwiGLUMLP.forward: down(silu(gate(x)) * up(x)), the product by Liger's kernel. With the runtime's rebuild
    path on (set_runtime(rebuild=True)), the down projection does not keep the product: backward runs the kernel
    again on the gate and up outputs Liger's function keeps (runtime.rebuilt_in_backward)."""
    silu_mul = _liger().silu_mul
    gate, up = self.gate_proj(x), self.up_proj(x)
    product = silu_mul(gate, up)
    if not rebuilds(self, product):  # a plain call where it is off (no context manager for dynamo to trace)
        return self.down_proj(product)
    with rebuilt_in_backward(self, product, lambda: silu_mul(gate, up)):
        return self.down_proj(product)


def _liger_module_of(model):
    """This file as the model's own code imported it: hf_tiny's, or the copy a remote-code folder ships beside its
    modeling_causal.py (its classes are not hf_tiny's, so only its own copy recognises them)."""
    for cls in type(model).__mro__:
        package, _, name = cls.__module__.rpartition(".")
        if name == "modeling_causal":
            return sys.modules.get(f"{package}.liger")
    return None


def _norms(base):
    """(RMSNorm, in_place) of the layers, their attention (q/k norms, MLA's) and the final norm. in_place (Liger's
    backward writes dX into dY) only where the norm's output gradient is a tensor of its own, as Liger does for
    Llama: the pre-norms and the final norm; a norm whose output goes straight into a residual sum (Gemma's and
    OLMo 2's output norms) shares its output gradient with the residual stream, and the attention's norms are not
    in place either. Identities (no norm there) are left out."""
    found = []
    for layer in base.layers:
        found += [(layer.input_layernorm, True), (layer.post_attention_layernorm, True),
                  (layer.attn_output_layernorm, False), (layer.mlp_output_layernorm, False)]
        found += [(norm, False) for norm in layer.self_attn.modules() if isinstance(norm, RMSNorm)]
    found.append((base.norm, True))
    return [(norm, in_place) for norm, in_place in found if norm is not None and not isinstance(norm, nn.Identity)]


def _liger_can_norm(norm: nn.Module) -> bool:
    """Our RMSNorm with a weight (Llama's or Gemma's casting), its forward not set by another tool."""
    return type(norm) is RMSNorm and norm.weight is not None and _forward_replaceable(norm)


def _forward_replaceable(module: nn.Module) -> bool:
    """The module runs its class's forward or Liger's: not one another tool set on it (accelerate's offloading
    hooks), which replacing would silently undo."""
    forward = vars(module).get("forward")
    function = getattr(forward, "__func__", None)
    return forward is None or getattr(function, "__module__", "").startswith("liger_kernel.")


def _feed_forwards(base):
    """Each dense layer's feed-forward, and each MoE layer's experts and shared experts."""
    for layer in base.layers:
        mlp = layer.mlp
        experts = getattr(mlp, "experts", None)
        if experts is None:
            yield mlp
            continue
        yield from experts
        if mlp.shared_experts is not None:
            yield mlp.shared_experts


def _gated_kind(mlp: nn.Module) -> Optional[str]:
    """"swiglu" for down(silu(gate(x)) * up(x)) (LigerSwiGLUMLP's forward), "geglu" for the tanh-approximated GELU
    gate (LigerGEGLUMLP's: Gemma's), with nothing in between; None for any other feed-forward."""
    if type(mlp) is not GatedFeedForward or mlp.dropout is not None or not _forward_replaceable(mlp):
        return None
    act = mlp.act_fn
    if "forward" in vars(act):
        return None
    if type(act) in {type(ACT2FN[name]) for name in SILU_NAMES}:
        return "swiglu"
    function = getattr(act, "act", None)  # GELUTanh's C kernel, not its pure-Python variant
    c_kernel = function is None or (getattr(function, "func", None) is F.gelu
                                    and function.keywords == {"approximate": "tanh"})
    return "geglu" if type(act) is type(ACT2FN[TANH_GELU_NAME]) and c_kernel else None


def _patch_rotary(base) -> tuple[int, int]:
    """Liger's RoPE on the attention modules of layers that rotate every dimension of each head by (cos, sin) and
    apply nothing after it. Returns (patched, left as they are)."""
    config = base.config
    rotated = 0
    for index, layer in enumerate(base.layers):
        attention, layer_type = layer.self_attn, config.layer_types[index]
        # the layer type's rotary module, as TinyCausalModel.rotary_positions picks it
        sliding = layer_type == "sliding_attention" and base.sliding_rotary_emb is not None
        rotary = base.sliding_rotary_emb if sliding else base.rotary_emb
        if (type(attention) is Attention and rotary is not None and index not in base.nope_layers
                and rotary.head_dim == attention.head_dim and attention.qk_norm_at != "rotated"):
            attention._positioned = _liger_rotary  # a plain function: replicas and pickles carry no bound module
            rotated += 1
    return rotated, len(base.layers) - rotated


def _liger_rotary(query, key, position_embeddings):
    """Attention._positioned for a layer that rotates by (cos, sin) over the whole head: Liger's RoPE kernel."""
    return _liger().rotary_pos_emb(query, key, *position_embeddings)


def _liger_causal_lm_loss(self, hidden_states, labels, *, ignore_index=-100, shift_labels=None,
                          num_items_in_batch=None):
    """TinyCausalForCausalLM._chunked_loss through Liger's fused linear cross-entropy: labels shifted as
    transformers' ForCausalLMLoss, Gemma's logit soft-capping, Trainer's num_items_in_batch."""
    return _liger().causal_lm_loss(
        hidden_states.contiguous(), self.lm_head.weight, labels, self.config.hidden_size,
        num_items_in_batch=num_items_in_batch, ignore_index=ignore_index, shift_labels=shift_labels,
        final_logit_softcapping=self.config.final_logit_softcapping,
    )


# ---- the table entry --------------------------------------------------------------------------------------------


def register_liger_kernels() -> None:
    """Puts MODEL_TYPE in Liger-Kernel's table of apply functions: now if Liger's table module is imported already,
    otherwise right after it is (Trainer imports it when use_liger_kernel=True). Without Liger, nothing happens."""
    table_module = sys.modules.get(LIGER_TABLE_MODULE)
    if table_module is not None:
        _add_to_table(table_module)
    elif not any(isinstance(finder, _AddToTableAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AddToTableAfterImport())


def _add_to_table(table_module) -> None:
    table_module.MODEL_TYPE_TO_APPLY_LIGER_FN.setdefault(MODEL_TYPE, apply_liger_kernel_to_hf_tiny)


class _AddToTableAfterImport(importlib.abc.MetaPathFinder):
    """A post-import hook: finds Liger's table module with the other finders and runs _add_to_table once the module
    has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != LIGER_TABLE_MODULE:
            return None
        spec = _spec_from_other_finders(self, name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _add_to_table(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)

        spec.loader.exec_module = exec_module
        return spec


def _spec_from_other_finders(hook, name, path, target) -> Optional[object]:
    for finder in sys.meta_path:
        if finder is hook or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path, target)
        if spec is not None:
            return spec
    return None

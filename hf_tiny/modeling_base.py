"""The PreTrainedModel base every hf_tiny family inherits: attention backend choice and weight init (saving and
model cards: saving.py)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from .runtime import configure as configure_runtime
from .attention import get_attention_interface, is_hf_tiny_backend, registered_attention_names
from .layers import Attention, RMSNorm
# loaded with the models, not on first use: it records the forwards as their classes define them (as_defined)
from .runtime_forms import as_defined  # noqa: F401
from .saving import AtomicSaveAndCardMixin
from .transformers_api import warn_if_torch_untested, without_retired_paged_prefix


def check_generation_kwargs(kwargs: dict) -> None:
    """generate() sets forward's return_dict itself: one passed to generate would reach forward twice (official
    forwards do not name it, so official generate refuses it as unused)."""
    if "return_dict" in kwargs:
        raise ValueError(f"generate() got return_dict={kwargs['return_dict']!r}, which generate sets itself; for a "
                         "ModelOutput from generate pass return_dict_in_generate=True")


def resolve_attn_implementation(requested) -> str:
    """None -> 'sdpa' (the Hugging Face default); otherwise one of our backends or a name registered in
    transformers' AttentionInterface (flex_attention, paged|eager, a user's function), or a clear error."""
    name = "sdpa" if requested is None else requested
    if not isinstance(name, str):
        raise TypeError(f"attn_implementation must be a string, got {type(requested).__name__}")
    name = without_retired_paged_prefix(name)
    get_attention_interface(name)  # raises, listing what is registered
    return name


def _transformers_flash(name) -> bool:
    """A FlashAttention function transformers provides (flash_attention_3, a hub kernel "org/repo"), not one of our
    backends. Unknown names are not: our error lists what exists."""
    if not isinstance(name, str) or "flash" not in name or is_hf_tiny_backend(name):
        return False
    return "/" in name or name in registered_attention_names()


class HfTinyPreTrainedModel(AtomicSaveAndCardMixin, PreTrainedModel):
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True  # attention goes through transformers' attention interface (vLLM checks it)
    _skip_keys_device_placement = ["past_key_values", "cache"]

    # Our backends live in hf_tiny/attention.py, so transformers' own checks (the flash-attn package, hub
    # kernels) do not apply to them: we validate names ourselves (ours, or registered with transformers). Overriding these keeps
    # `from_pretrained(attn_implementation=...)` and `set_attn_implementation(...)` working without warnings.
    # transformers' own flash functions (flash_attention_3, hub flash kernels) keep its checks, and their clear errors
    # where the package is missing or the device cannot run it.
    def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check=False, *args, **kwargs):
        if _transformers_flash(attn_implementation):
            return super()._check_and_adjust_attn_implementation(attn_implementation, is_init_check, *args, **kwargs)
        return resolve_attn_implementation(attn_implementation)

    def get_correct_attn_implementation(self, requested_attention, is_init_check=False, *args, **kwargs):
        if _transformers_flash(requested_attention):
            return super().get_correct_attn_implementation(requested_attention, is_init_check, *args, **kwargs)
        return resolve_attn_implementation(requested_attention)

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True

    def post_init(self) -> None:
        """transformers' post_init; warns once per process when the installed torch lies outside the tested range
        (transformers_api.py)."""
        super().post_init()
        warn_if_torch_untested()

    def set_runtime(self, enabled: bool = True, **paths: bool) -> "HfTinyPreTrainedModel":
        """The runtime (runtime.py) of this model. set_runtime(False): every module runs its modeling file's forward;
        set_runtime(True): each path at its device default (runtime.ON_BY_DEFAULT); a path named with True or False
        (recompute=, in_place=, few_rows=, chunked_loss=, fit_memory=) on or off on every device, e.g.
        set_runtime(recompute=True) to recompute training activations on a GPU (a named option there, as gradient
        checkpointing is), set_runtime(fit_memory=False) to let a CUDA training step that does not fit run out of
        memory instead of replaying the layers it has no memory for (memory_fit.py, on by default on CUDA)."""
        return configure_runtime(self, enabled, **paths)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Initializes a module that from_pretrained found a tensor missing for, or a new model's. Through
        transformers.initialization, as official models: it leaves the tensors that were loaded as they are (a
        tensor method such as .normal_() would overwrite the loaded siblings of a missing bias)."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
            # a row of the weight does not carry the weight's "loaded" flag: checked here
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            if module.weight is not None:
                init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, RMSNorm) and module.weight is not None:
            init.constant_(module.weight, 0.0 if module.unit_offset else 1.0)
        elif isinstance(module, Attention) and module.sinks is not None:
            init.normal_(module.sinks, mean=0.0, std=std)  # as official GPT-OSS
        # from_pretrained fills non-persistent buffers with garbage (empty_like on meta): modules that own such
        # buffers (RoPE inv_freq, position ids) rebuild them here.
        init_buffers = getattr(module, "_init_buffers", None)
        if callable(init_buffers):
            init_buffers()

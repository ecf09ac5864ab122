"""The measured calls: prefill forward, training step, generate(). Each builder returns a zero-argument callable
doing one unit of work, so the timing loop and the memory probe run exactly the same thing on both sides."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch

PREFILL = "prefill"
TRAIN = "train_step"
DECODE = "generate"
DECODE_COMPILED = "generate_compiled"  # static cache + torch.compile, on fresh copies of both models
CASES = (PREFILL, TRAIN, DECODE, DECODE_COMPILED)


@dataclass(frozen=True)
class Shape:
    batch: int
    seq: int  # tokens per sequence (the prompt length for generate)
    new_tokens: int = 0  # generate only

    def label(self) -> str:
        text = f"{self.batch}x{self.seq}"
        return text + f" +{self.new_tokens} new" if self.new_tokens else text


def random_ids(batch: int, seq: int, vocab_size: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Token ids away from the special tokens at both ends of the vocabulary, fixed by the seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size - 100, (batch, seq), generator=gen).to(device)


def accepts(model, name: str) -> bool:
    params = inspect.signature(model.forward).parameters
    return name in params


def prefill_kwargs(models: dict) -> dict:
    """Extra forward arguments of a causal prefill, identical for both sides: no cache, and logits of the last
    position only (what generate() asks for) when every side supports `logits_to_keep`."""
    kwargs = {"use_cache": False}
    if all(accepts(model, "logits_to_keep") for model in models.values()):
        kwargs["logits_to_keep"] = 1
    return kwargs


def build_prefill(model, family: str, shape: Shape, device: torch.device, extra: Optional[dict] = None) -> Callable:
    ids = random_ids(shape.batch, shape.seq, model.config.vocab_size, device)
    mask = torch.ones_like(ids)
    kwargs = dict(extra or {}) if family == "causal" else {}

    @torch.inference_mode()
    def prefill():
        return model(input_ids=ids, attention_mask=mask, **kwargs)

    return prefill


def build_train_step(model, family: str, shape: Shape, device: torch.device, lr: float = 1e-6) -> Callable:
    """forward + backward + AdamW step. Encoder loss: mean square of the last hidden state (the same function on
    both sides); causal loss: the model's own next-token cross-entropy with labels = input_ids."""
    ids = random_ids(shape.batch, shape.seq, model.config.vocab_size, device)
    mask = torch.ones_like(ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def train_step():
        model.train()
        if family == "encoder":
            out = model(input_ids=ids, attention_mask=mask)
            loss = out.last_hidden_state.float().pow(2).mean()
        else:
            loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        return loss.detach()

    train_step.optimizer = optimizer
    return train_step


def build_generate(
    model, shape: Shape, device: torch.device, new_tokens: Optional[int] = None, static_cache: bool = False,
    compile_config=None,
) -> Callable:
    """Greedy generate() of exactly `new_tokens` tokens per sequence (min_new_tokens = max_new_tokens, so an
    end-of-sequence token cannot stop one side early). static_cache: generate(cache_implementation="static").
    compile_config (a transformers CompileConfig, with static_cache): generate's own auto-compile of the decoding
    step (captured_decoding_config), the prefill eager."""
    ids = random_ids(shape.batch, shape.seq, model.config.vocab_size, device)
    mask = torch.ones_like(ids)
    count = shape.new_tokens if new_tokens is None else new_tokens
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id
    extra = {"cache_implementation": "static"} if static_cache else {}
    if compile_config is not None:
        if not static_cache:
            raise ValueError("compile_config needs static_cache=True: generate compiles only with a static cache")
        extra["compile_config"] = compile_config

    @torch.inference_mode()
    def generate():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=count,
            min_new_tokens=count,
            do_sample=False,
            pad_token_id=pad,
            **extra,
        )

    return generate


def compile_for_decoding(model, device: torch.device) -> None:
    """The recipe transformers documents for fast decoding: forward wrapped in torch.compile (CUDA graphs on a
    GPU), used with a static cache. generate()'s own auto-compile is switched off so it is compiled once."""
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    model.forward = torch.compile(model.forward, mode=mode, dynamic=False)
    model.generation_config.disable_compile = True


def captured_decoding_config(device: torch.device):
    """The CompileConfig of captured decoding: transformers' default (inductor, mode "reduce-overhead", i.e. CUDA
    graphs) on CUDA. Elsewhere generate does not auto-compile; there (the GPU check's dry run on a CPU) dynamo
    traces the step with the eager backend, which checks the capture without minutes of C++ compilation."""
    from transformers import CompileConfig

    if device.type == "cuda":
        return CompileConfig(mode="reduce-overhead")
    config = CompileConfig(backend="eager")
    config._compile_all_devices = True  # generate's own switch for compiling off CUDA
    return config


def apply_liger(model) -> dict:
    """What TrainingArguments(use_liger_kernel=True) does to a model: transformers' own entry point
    (integrations.liger.apply_liger_kernel, which calls Liger-Kernel's _apply_liger_kernel_to_instance; older
    transformers call that directly). Returns {"modules_patched": how many modules, the model itself included,
    have another class or forward after it}. Raises ImportError when liger_kernel is absent."""
    import liger_kernel  # noqa: F401  (ImportError: the row says "not installed")

    try:
        from transformers.integrations.liger import apply_liger_kernel
    except ImportError:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        def apply_liger_kernel(model, config):
            _apply_liger_kernel_to_instance(model=model, **config)

    before = {name: (type(module), module.forward) for name, module in model.named_modules()}
    apply_liger_kernel(model, {})
    changed = [name for name, module in model.named_modules() if before.get(name) != (type(module), module.forward)]
    return {"modules_patched": len(changed)}


def build(case: str, model, family: str, shape: Shape, device: torch.device, prefill_extra: Optional[dict] = None):
    if case == PREFILL:
        return build_prefill(model, family, shape, device, prefill_extra)
    if case == TRAIN:
        return build_train_step(model, family, shape, device)
    if case in (DECODE, DECODE_COMPILED):
        if family != "causal":
            raise ValueError(f"case {case!r} needs a causal model, got family {family!r}")
        return build_generate(model, shape, device, static_cache=case == DECODE_COMPILED)
    raise ValueError(f"unknown case {case!r}; choose one of {list(CASES)}")

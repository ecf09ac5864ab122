"""Cross-entropy of a linear head without the full [tokens, vocab] logits.

An LM's training loss is F.cross_entropy(hidden @ W.T, targets). Written that way autograd keeps the fp32 logits,
their log-softmax and, in backward, their gradient: three [tokens, vocab] tensors (SmolLM2 at 4x512 tokens:
0.4 GB each), the largest activations of a small model's training step. Here the tokens go through the head a
chunk at a time, and each chunk's gradient is formed on the spot, since d loss / d logits = softmax - one_hot is
known as soon as the chunk's logits are:

    grad_hidden[chunk] = g @ W          grad_W += g.T @ hidden[chunk]          g = (softmax - one_hot) / divisor

so only one chunk's logits ever exist, and the backward pass just hands over the two gradients (scaled by the
incoming gradient). The matrix products are the same three an unchunked forward + backward does, so nothing is
recomputed. The loss equals the unchunked one up to fp32 summation order.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .memory_fit import current_plan
from .runtime import path_on, plain_linear, under_functorch
from .step import check_skip_logits

# Logits elements per chunk (fp32: 32 MiB): large enough that each chunk's matrix product runs at full speed.
CHUNK_LOGIT_ELEMENTS = 1 << 23


def chunk_tokens_for(vocab_size: int) -> int:
    return max(1, CHUNK_LOGIT_ELEMENTS // vocab_size)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, ignore_index, softcap, chunk_tokens):
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_grad = need_hidden or need_weight or need_bias
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)  # bf16 / fp16 heads sum chunks in fp32
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=accumulate, device=bias.device) if need_bias else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk = hidden[rows]
            logits = torch.nn.functional.linear(chunk, weight, bias)
            if softcap is not None:  # Gemma: c * tanh(z / c), in the head's dtype as the unchunked logits are
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
                capped = capped.float()
            logits = logits.float()
            target = targets[rows]
            valid = target != ignore_index
            safe_target = target.masked_fill(~valid, 0)[:, None]
            log_normalizer = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe_target).squeeze(1)
            total += torch.where(valid, log_normalizer - picked, 0.0).sum()
            if not need_grad:
                continue
            grad = torch.exp(logits.sub_(log_normalizer[:, None]))  # softmax, in place of the logits
            grad.scatter_add_(1, safe_target, -valid[:, None].to(grad.dtype))
            grad.mul_(torch.where(valid, 1 / divisor, 0.0)[:, None])  # ignored rows 0, also when divisor is 0
            if softcap is not None:
                grad.mul_(1.0 - capped * capped)
            if need_bias:
                grad_bias += grad.sum(0)
            grad = grad.to(weight.dtype)
            if need_hidden:
                grad_hidden[rows] = grad @ weight
            if need_weight and grad_weight.dtype == weight.dtype:
                grad_weight.addmm_(grad.t(), chunk.to(weight.dtype))  # in place: no [vocab, hidden] temporary
            elif need_weight:
                grad_weight += (grad.t() @ chunk.to(weight.dtype)).to(accumulate)
        ctx.save_for_backward(
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        )
        return total / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():  # create_graph=True: the gradients were computed in forward, as constants
            raise RuntimeError(
                "the chunked loss computes its gradients in the forward pass and has no second derivative "
                "(backward with create_graph=True, e.g. a gradient penalty); pass skip_logits=False to the forward, "
                "or model.set_runtime(chunked_loss=False)"
            )
        grads = list(ctx.saved_tensors)
        # grad_loss is 1.0 unless the loss was scaled (gradient accumulation, a loss weight); multiplying by 1.0 is
        # exact, and not branching on its value keeps the backward free of a host sync (torch.compile, export)
        grads = [None if g is None else g * grad_loss.to(g.dtype) for g in grads]
        return (*grads, None, None, None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
    softcap: Optional[float] = None,
    chunk_tokens: Optional[int] = None,
) -> torch.Tensor:
    """F.cross_entropy(F.linear(hidden, weight, bias) [softcapped].float(), targets, ignore_index=...) without the
    full logits. hidden: [..., H], targets: [...] (already aligned with hidden: shift them first for a causal LM).
    Reduction as transformers' LM losses: the mean over non-ignored targets, or the sum divided by
    num_items_in_batch when given (Trainer's gradient-accumulation-exact normalisation)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets cover {targets.shape[0]} tokens but hidden states {hidden.shape[0]}")
    if num_items_in_batch is None:
        divisor = (targets != ignore_index).sum().to(torch.float32)  # 0 gives nan, as F.cross_entropy's mean
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device).to(torch.float32)
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, divisor, ignore_index, softcap, chunk)


def use_chunked_loss(skip_logits: Optional[bool], labels, *, model, head) -> bool:
    """An LM head's choice: skip_logits (Liger-Kernel's name) True = the loss without logits, False = logits as
    usual, None = skip while training with labels where the runtime's "chunked_loss" path is on for the labels' device
    (runtime.ON_BY_DEFAULT: the CPU), or where the forward's memory plan needs it (memory_fit.py). Skipping needs
    labels and a plain linear head."""
    check_skip_logits(skip_logits, labels)
    if skip_logits is None and model.training and labels is not None:
        skip_logits = path_on(model, "chunked_loss", labels.device)
        if not skip_logits and not torch.compiler.is_compiling():  # dynamo cannot read the plan's ContextVar
            plan = current_plan()
            skip_logits = plan is not None and plan.chunk_loss
    # a PEFT-wrapped, quantized or hooked head, or a torch.func transform: unchunked
    return bool(skip_logits) and plain_linear(head) and not under_functorch()


def labels_ahead(labels: torch.Tensor, ahead: int, ignore_index: int = -100) -> torch.Tensor:
    """The target of position i is token i + ahead of the unshifted labels, for positions 0 .. T - ahead (the last
    gets ignore_index): ahead=1 is the causal LM's shift; an MTP module of depth k predicts ahead = k + 1."""
    return torch.nn.functional.pad(labels[..., ahead:], (0, 1), value=ignore_index)

"""Multi-Token Prediction (DeepSeek-V3 technical report, section 2.2, eq. 21-25): D extra modules, the k-th of
which predicts the token k + 1 positions ahead, trained beside the next-token loss and used at inference to draft
tokens that the main model then verifies (self-speculative decoding).

Module k (k = 1 .. D), at every position i, from the previous depth's hidden state h^{k-1}_i (h^0: the main
model's output after its final norm) and the embedding of token t_{i+k}:
    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]          (eq. 21; `eh_proj`, `enorm`, `hnorm`)
    h^k    = TRM_k(h'^k)  over positions 1 .. T-k, causally            (eq. 22; `block`, a decoder block)
    P^k_{i+k+1} = OutHead(h^k_i) = softmax(lm_head(RMSNorm(h^k_i)))    (eq. 23; `norm`, the shared lm_head)
    L^k = CrossEntropy(P^k, t_{k+2 .. T+1})                            (eq. 24)
    L_MTP = (lambda / D) * sum_k L^k                                    (eq. 25; lambda = config.mtp_loss_weight)
The report writes the concatenation as [h; Emb]; the released checkpoints' eh_proj takes [Emb; h] (the layout
DeepSeek's and vLLM's inference code use), which is the one here. The embedding and the output head are the
main model's (shared, as in the report); checkpoints store copies of them per module, which conversion checks
equal. The block's rotary positions are those of position i.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .layers import TransformerBlock
from .masks import AttentionMask
from .norms import build_norm


class MtpLayer(nn.Module):
    """One MTP module (depth k); `layer_idx` = num_hidden_layers + k - 1, the index checkpoints store it under."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        hidden = config.hidden_size

        def norm():
            return build_norm(config.norm_type, hidden, config.norm_eps(), unit_offset=config.rms_norm_unit_offset,
                              bias=config.norm_bias)

        self.enorm, self.hnorm = norm(), norm()
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = TransformerBlock(config, config.block_spec(layer_idx), layer_idx)
        self.norm = norm()  # the shared head's own norm (checkpoints: shared_head.norm)

    def forward(
        self,
        previous_hidden: torch.Tensor,
        next_embeddings: torch.Tensor,
        mask: AttentionMask,
        position_embeddings,
        cache=None,
    ) -> torch.Tensor:
        """previous_hidden h^{k-1} [B, n, d], next_embeddings Emb(t_{i+k}) [B, n, d] -> h^k [B, n, d] (before `norm`)."""
        merged = self.eh_proj(torch.cat((self.enorm(next_embeddings), self.hnorm(previous_hidden)), dim=-1))
        hidden, _, _, _ = self.block(
            merged, mask.mask, position_embeddings, is_causal=mask.is_causal, segment_ids=mask.segment_ids,
            cache=cache,
        )
        return hidden


@torch.no_grad()
def speculative_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_ids: set) -> tuple[list, dict]:
    """Self-speculative greedy decoding of one sequence (prompt [1, n], no padding): each round the MTP modules
    draft D tokens from the last verified position (depth k drafts token m + k), the main model scores the latest
    verified token and the drafts in one forward, and the longest prefix of drafts equal to its greedy choices is
    kept plus its next greedy token. The tokens are exactly those of greedy decoding (up to the rounding of a
    multi-token forward against one token at a time); the caches are cut back past every rejected draft.

    Returns (new token ids, {"rounds", "drafted", "accepted"})."""
    from transformers.cache_utils import DynamicCache

    base, head = model.model, model.lm_head
    layers = list(model.mtp)
    device = prompt.device
    main_cache = DynamicCache(config=model.config)
    out = base(input_ids=prompt, cache=main_cache, use_cache=True)
    hidden = [out.last_hidden_state]  # hidden[k]: h^k at positions 0 .. len - 1
    hidden += [out.last_hidden_state[:, :0]] * len(layers)
    caches = [DynamicCache() for _ in layers]
    tokens = prompt[0].tolist()
    tokens.append(int(head(out.last_hidden_state[:, -1]).argmax(-1)))
    new = [tokens[-1]]
    stats = {"rounds": 0, "drafted": 0, "accepted": 0}
    full = "full_attention"
    while len(new) < max_new_tokens and new[-1] not in eos_token_ids:
        m = len(tokens) - 1  # tokens[m]: the latest verified token, not yet in the main cache
        drafts: list[int] = []
        for k, layer in enumerate(layers, start=1):
            done = hidden[k].shape[1]
            sequence = tokens + drafts
            ids = torch.tensor([sequence[done + k : m + k]], device=device)
            positions = torch.arange(done, m, device=device)[None]
            states = layer(
                hidden[k - 1][:, done:m], base._embed(ids), AttentionMask(None, True),
                base._position_embeddings(hidden[0], positions)[full], caches[k - 1],
            )
            hidden[k] = torch.cat((hidden[k], states), dim=1)
            drafts.append(int(head(layer.norm(hidden[k][:, -1])).argmax(-1)))
        drafts = drafts[: max_new_tokens - len(new) - 1]  # a round yields at most len(drafts) + 1 tokens
        chunk = torch.tensor([[tokens[m], *drafts]], device=device)
        positions = torch.arange(m, m + chunk.shape[1], device=device)[None]
        out = base(input_ids=chunk, cache=main_cache, position_ids=positions, use_cache=True)
        greedy = head(out.last_hidden_state[0]).argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted] and drafts[accepted] not in eos_token_ids:
            accepted += 1
        stats["rounds"] += 1
        stats["drafted"] += len(drafts)
        stats["accepted"] += accepted
        produced = drafts[:accepted] + [greedy[accepted]]
        tokens += produced
        new += produced
        # keep what was computed from verified tokens only
        _truncate(main_cache, m + accepted + 1, 0)
        hidden[0] = torch.cat((hidden[0], out.last_hidden_state[:, : accepted + 1]), dim=1)
        verified = len(tokens) - 1
        for k in range(1, len(layers) + 1):
            keep = min(hidden[k].shape[1], hidden[k - 1].shape[1], verified - k + 1)
            hidden[k] = hidden[k][:, :keep]
            _truncate(caches[k - 1], keep, layers[k - 1].block.self_attn.layer_idx)
    return _cut_at_eos(new, eos_token_ids)[:max_new_tokens], stats


def _cut_at_eos(tokens: list, eos_token_ids: set) -> list:
    for index, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: index + 1]
    return tokens


def _truncate(cache, length: int, layer_idx: int) -> None:
    """Drops cached positions from `length` on (a negative crop: tokens to remove, in every transformers 4/5);
    layer_idx: a layer the cache holds (an MTP cache holds only its module's)."""
    current = cache.get_seq_length(layer_idx)
    if current > length:
        cache.crop(length - current)


__all__ = ["MtpLayer", "speculative_greedy"]

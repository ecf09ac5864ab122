"""Multi-Token Prediction (DeepSeek-V3 technical report, section 2.2, eq. 21-25): D extra modules, the k-th of
which predicts the token k + 1 positions ahead, trained beside the next-token loss and used at inference to draft
tokens that the main model then verifies (self-speculative decoding).

Module k (k = 1 .. D), at every position i, from the previous depth's hidden state h^{k-1}_i (h^0: the main
model's output after its final norm) and the embedding of token t_{i+k}:
    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]          (eq. 21; `eh_proj`, `enorm`, `hnorm`)
    h^k    = TRM_k(h'^k)  over positions 1 .. T-k, causally            (eq. 22; `block`, a decoder layer)
    P^k_{i+k+1} = OutHead(h^k_i) = softmax(lm_head(RMSNorm(h^k_i)))    (eq. 23; `norm`, the shared lm_head)
    L^k = CrossEntropy(P^k, t_{k+2 .. T+1})                            (eq. 24)
    L_MTP = (lambda / D) * sum_k L^k                                    (eq. 25; lambda = config.mtp_loss_weight)
The report writes the concatenation as [h; Emb]; the released checkpoints' eh_proj takes [Emb; h] (the layout
DeepSeek's and vLLM's inference code use), which is the one here. The embedding and the output head are the
main model's (shared, as in the report); checkpoints store copies of them per module, which conversion checks
equal. The block's rotary positions are those of position i.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from .chunked_loss import labels_ahead
from .layers import build_norm
from .masks import AttentionMask, CausalShape, causal_mask, packed_causal_mask, segment_ids_from_position_ids


class MtpLayer(nn.Module):
    """One MTP module (depth k) around `block`, a decoder layer indexed num_hidden_layers + k - 1 as checkpoints
    store it."""

    def __init__(self, config, block: nn.Module):
        super().__init__()
        hidden = config.hidden_size

        def norm():
            return build_norm(config.norm_type, hidden, config.norm_type_eps(), unit_offset=config.rms_norm_unit_offset,
                              bias=config.norm_bias, float32_product=config.rounding.norm_product_float32)

        self.enorm, self.hnorm = norm(), norm()
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.norm = norm()  # the shared head's own norm (checkpoints: shared_head.norm)

    def forward(self, previous_hidden: torch.Tensor, next_embeddings: torch.Tensor, mask: AttentionMask,
                position_embeddings, cache=None) -> torch.Tensor:
        """previous_hidden h^{k-1} [B, n, d], next_embeddings Emb(t_{i+k}) [B, n, d] -> h^k [B, n, d] (before `norm`)."""
        merged = self.eh_proj(torch.cat((self.enorm(next_embeddings), self.hnorm(previous_hidden)), dim=-1))
        return self.block(merged, mask, position_embeddings, cache=cache)


def mtp_mask(attention_mask, position_ids: torch.Tensor, batch_size: int, length: int) -> AttentionMask:
    """The mask of a Multi-Token Prediction block over `length` positions without a cache: the 2-D padding mask's,
    packed rows' (restarting position_ids), or plain causal; full attention."""
    if attention_mask is None and position_ids.shape[0] == batch_size:
        segment_ids = segment_ids_from_position_ids(position_ids)
        if segment_ids is not None:
            return packed_causal_mask(segment_ids)
    shape = CausalShape(batch_size, length, 0, position_ids.device)
    return causal_mask(attention_mask, None, shape, None, layer_idx=0)


def mtp_loss(model, hidden_states, input_ids, attention_mask, position_ids, labels, kwargs, loss_kwargs):
    """L_MTP = mtp_loss_weight / D * sum_k L^k: depth k runs on positions 0 .. T-k-1 with the embeddings of tokens
    k .. T-1 and predicts tokens k+1 .. T (labels, unshifted, -100 ignored)."""
    if input_ids is None or any(key.startswith("cu_seq_lens") for key in kwargs):
        raise ValueError(
            "the Multi-Token Prediction loss needs input_ids (it embeds tokens t+1 .. t+D) and no cu_seq_lens_*; "
            "pass input_ids, or set mtp_loss_weight=0"
        )
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        raise ValueError("the Multi-Token Prediction loss takes a 2-D padding attention_mask (or none)")
    batch, length = input_ids.shape
    ignore_index = loss_kwargs.get("ignore_index", -100)
    total, previous = hidden_states.new_zeros(()), hidden_states
    for depth, layer in enumerate(model.mtp, start=1):
        n = length - depth
        if n < 1:
            break
        positions = torch.arange(n, device=input_ids.device)[None] if position_ids is None else position_ids[..., :n]
        mask = mtp_mask(None if attention_mask is None else attention_mask[:, :n], positions, batch, n)
        rotary = model.model.rotary_positions(previous, positions)
        previous = layer(previous[:, :n], model.model.embed_tokens(input_ids[:, depth:]), mask, rotary)
        total = total + model._head_loss(
            layer.norm(previous), labels_ahead(labels, depth + 1, ignore_index), ignore_index=ignore_index,
            num_items_in_batch=loss_kwargs.get("num_items_in_batch"),
        )
    return model.config.mtp.mtp_loss_weight / len(model.mtp) * total


_UNSET = object()  # an argument not given (None is a value: "no eos token")


# generation_config fields that change which token greedy decoding picks (sampling, beams, penalties, constraints)
TOKEN_CHOOSING_FIELDS = (
    "do_sample", "num_beams", "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
    "min_length", "min_new_tokens", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
    "forced_eos_token_id", "sequence_bias", "exponential_decay_length_penalty", "force_words_ids", "constraints",
)


def _refuse_settings_it_cannot_honour(generation) -> None:
    """The model's generation_config may set what plain generate() would apply (a published generation_config.json
    often sets repetition_penalty or do_sample); the MTP loop is plain greedy decoding, so it refuses them."""
    from transformers import GenerationConfig

    neutral = GenerationConfig()
    changed = {name: getattr(generation, name, None) for name in TOKEN_CHOOSING_FIELDS
               if getattr(generation, name, None) != getattr(neutral, name, None)}
    if changed:
        raise ValueError(
            f"generate(use_mtp=True) is plain greedy decoding, and the model's generation_config sets {changed}, "
            "which generate() would apply: reset them (model.generation_config.<field> = its default) or decode "
            "with generate() without use_mtp"
        )


def generate_with_mtp(model, input_ids=None, attention_mask=None, *, max_new_tokens=None, eos_token_id=_UNSET,
                      pad_token_id=_UNSET, do_sample=False, num_beams=1, **unsupported):
    """generate(use_mtp=True): greedy decoding with the MTP modules drafting, one sequence at a time (left-padded
    batches are split by attention_mask). Takes input_ids, attention_mask, max_new_tokens, eos_token_id,
    pad_token_id; returns the ids like generate() and leaves the acceptance counts in model.mtp_stats. Anything
    else (sampling, beams) is an error."""
    if model.mtp is None:
        raise ValueError("generate(use_mtp=True) needs Multi-Token Prediction modules; num_nextn_predict_layers=0")
    if unsupported or do_sample or num_beams != 1:
        raise ValueError(
            "generate(use_mtp=True) is greedy self-speculative decoding: do_sample=False and num_beams=1 only, and "
            f"input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id; got do_sample={do_sample}, "
            f"num_beams={num_beams}, other arguments {sorted(unsupported)}"
        )
    if input_ids is None or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, length] tensor, got {None if input_ids is None else tuple(input_ids.shape)}")
    generation = model.generation_config
    _refuse_settings_it_cannot_honour(generation)
    max_new_tokens = generation.max_new_tokens if max_new_tokens is None else max_new_tokens
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    # as generate(): an argument given (None included) replaces the generation config's value
    eos = generation.eos_token_id if eos_token_id is _UNSET else eos_token_id
    eos_ids = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
    pad = generation.pad_token_id if pad_token_id is _UNSET else pad_token_id
    pad = min(eos_ids, default=0) if pad is None else pad
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    rows, model.mtp_stats = [], {"rounds": 0, "drafted": 0, "accepted": 0}
    for row, mask in zip(input_ids, attention_mask):
        real = int(mask.sum())
        if real == 0 or not bool(mask[mask.shape[0] - real :].all()):
            raise ValueError("generate(use_mtp=True) takes left-padded rows (each row's real tokens last, at least one)")
        new, stats = speculative_greedy(model, row[mask.shape[0] - real :][None], max_new_tokens, eos_ids)
        rows.append(new)
        for key in stats:
            model.mtp_stats[key] += stats[key]
    tail = torch.full((input_ids.shape[0], max(len(new) for new in rows)), pad, dtype=input_ids.dtype, device=input_ids.device)
    for index, new in enumerate(rows):
        tail[index, : len(new)] = torch.tensor(new, dtype=input_ids.dtype)
    return torch.cat((input_ids, tail), dim=1)


@torch.no_grad()
def speculative_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_ids: set) -> tuple[list, dict]:
    """Self-speculative greedy decoding of one sequence (prompt [1, n], no padding): each round the MTP modules
    draft D tokens from the last verified position (depth k drafts token m + k), the main model scores the latest
    verified token and the drafts in one forward, and the longest prefix of drafts equal to its greedy choices is
    kept plus its next greedy token. The tokens are exactly those of greedy decoding (up to the rounding of a
    multi-token forward against one token at a time); the caches are cut back past every rejected draft.

    Returns (new token ids, {"rounds", "drafted", "accepted"})."""
    base, head, layers = model.model, model.lm_head, list(model.mtp)
    device = prompt.device
    main_cache = DynamicCache(config=model.config)
    out = base(input_ids=prompt, cache=main_cache, use_cache=True)
    hidden = [out.last_hidden_state] + [out.last_hidden_state[:, :0]] * len(layers)  # hidden[k]: h^k so far
    caches = [DynamicCache() for _ in layers]
    tokens = prompt[0].tolist()
    tokens.append(int(head(out.last_hidden_state[:, -1]).argmax(-1)))
    new = [tokens[-1]]
    stats = {"rounds": 0, "drafted": 0, "accepted": 0}
    while len(new) < max_new_tokens and new[-1] not in eos_token_ids:
        m = len(tokens) - 1  # tokens[m]: the latest verified token, not yet in the main cache
        drafts = _draft(base, head, layers, hidden, caches, tokens, m, device)[: max_new_tokens - len(new) - 1]
        chunk = torch.tensor([[tokens[m], *drafts]], device=device)
        positions = torch.arange(m, m + chunk.shape[1], device=device)[None]
        out = base(input_ids=chunk, cache=main_cache, position_ids=positions, use_cache=True)
        greedy = head(out.last_hidden_state[0]).argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted] and drafts[accepted] not in eos_token_ids:
            accepted += 1
        stats["rounds"], stats["drafted"], stats["accepted"] = stats["rounds"] + 1, stats["drafted"] + len(drafts), stats["accepted"] + accepted
        produced = drafts[:accepted] + [greedy[accepted]]
        tokens += produced
        new += produced
        _truncate(main_cache, m + accepted + 1, 0)  # keep what was computed from verified tokens only
        hidden[0] = torch.cat((hidden[0], out.last_hidden_state[:, : accepted + 1]), dim=1)
        for k in range(1, len(layers) + 1):
            keep = min(hidden[k].shape[1], hidden[k - 1].shape[1], len(tokens) - k)
            hidden[k] = hidden[k][:, :keep]
            _truncate(caches[k - 1], keep, layers[k - 1].block.self_attn.layer_idx)
    return _cut_at_eos(new, eos_token_ids)[:max_new_tokens], stats


def _draft(base, head, layers, hidden: list, caches: list, tokens: list, m: int, device) -> list:
    """Each depth k drafts token m + k from the positions it has not seen yet (hidden[k] grows in place)."""
    drafts: list[int] = []
    for k, layer in enumerate(layers, start=1):
        done = hidden[k].shape[1]
        ids = torch.tensor([(tokens + drafts)[done + k : m + k]], device=device)
        positions = torch.arange(done, m, device=device)[None]
        states = layer(hidden[k - 1][:, done:m], base.embed_tokens(ids), AttentionMask(None, True),
                       base.rotary_positions(hidden[0], positions), caches[k - 1])
        hidden[k] = torch.cat((hidden[k], states), dim=1)
        drafts.append(int(head(layer.norm(hidden[k][:, -1])).argmax(-1)))
    return drafts


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


__all__ = ["MtpLayer", "generate_with_mtp", "mtp_loss", "speculative_greedy"]

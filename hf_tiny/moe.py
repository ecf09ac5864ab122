"""Mixture-of-Experts feed-forward: a router picks k of E expert MLPs for each token, and the token's output is
the weighted sum of those k experts' outputs (plus, in some models, shared experts that see every token). `Moe` is
the causal config's table of its fields (causal_mechanisms.py holds the other mechanisms' tables).

Parameters grow with E while the compute per token stays that of k experts. The three routings of today's
checkpoints are options of one router:

- Mixtral / Qwen-MoE: probabilities = softmax(logits); the k largest; renormalized to sum 1 when
  norm_topk_prob (Mixtral always, Qwen per config).
- GPT-OSS ("topk_softmax"): the k largest logits (its router has a bias), softmax over those k, in the logits'
  dtype; the same weights as Mixtral's up to rounding, in the order official computes them.
- DeepSeek-V3: scores = sigmoid(logits) (in fp32). The *choice* adds a learned-free correction bias per expert
  (`e_score_correction_bias`, adjusted outside backprop to balance load), and is restricted to the topk_group
  best of n_group expert groups (a group's score: the sum of its two best scores); the *weights* are the
  uncorrected scores of the chosen experts, renormalized when norm_topk_prob, times routed_scaling_factor.
- Llama 4 ("topk_sigmoid"): the k largest logits choose, each weighed by its sigmoid; and the weight multiplies
  the token going into the expert rather than what comes out (`weights_on_input`).

The experts run in a plain loop over experts (each takes the tokens routed to it), which is what every official
implementation's reference path does. A compiled decoding step runs the same sums in fixed shapes instead (every
expert on every token, the unchosen dropped; COMPILED_DENSE_MAX_TOKENS says when and what it costs).
`load_balancing_loss` is the Switch Transformer auxiliary loss as transformers computes it for Mixtral / Qwen-MoE.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from .causal_mechanisms import Mechanism
from .transformers_api import deepseek_router_float32
from .validation import check_bool, check_choice, check_divisible, check_non_negative, check_non_negative_number
from .validation import check_positive, check_positive_number, check_probability

ROUTER_SCORINGS = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid")
MLP_LAYER_TYPES = ("dense", "sparse")
# Under torch.compile, a MoE layer of at most this many tokens (a decoding step's batch) runs every expert on every
# token, in fixed shapes, so that the step compiles as one graph (the model declares _can_compile_fullgraph) and a
# CUDA graph can replay it; a longer input keeps the routed loop, whose routing-sized shapes break the graph (and
# sync with the host on a GPU), rather than pay E / k times the experts' products. The cost, where reading the
# weights is the time: every expert's weights at every step. Compiled decoding of a random 8-expert top-2 Mixtral on
# a 2-core CPU (benchmarks/moe_decode.py, 2026-11-28): 0.48x the routed loop's tokens/s at batch 1, 1.13x at 8, 0.86x
# at 32. On a GPU the routed loop also syncs with the host at every expert; the GPU check measures it.
COMPILED_DENSE_MAX_TOKENS = 64


@dataclass(frozen=True)
class Moe(Mechanism):
    """Mixture-of-Experts (Mixtral, Qwen-MoE, DeepSeek-V3, GPT-OSS, Llama 4; moe.py), on when num_local_experts > 0:
    - num_local_experts E routed experts (SwiGLU, moe_intermediate_size wide; default intermediate_size), of which
      the router picks num_experts_per_tok per token.
    - router_scoring: "softmax" (Mixtral, Qwen), "sigmoid" (DeepSeek-V3, with e_score_correction_bias),
      "topk_softmax" (GPT-OSS: the k largest router logits, softmax over them, in their dtype) or "topk_sigmoid"
      (Llama 4: the k largest logits choose, weighed by their sigmoid); norm_topk_prob renormalizes the k weights;
      routed_scaling_factor multiplies them; n_group / topk_group restrict the choice to the best groups of experts
      (DeepSeek-V3).
    - shared_expert_intermediate_size > 0: shared experts every token goes through (DeepSeek: n_shared_experts *
      moe_intermediate_size), scaled by sigmoid(shared_expert_gate(x)) when shared_expert_gate (Qwen2-MoE).
    - mlp_layer_types: "dense" or "sparse" per layer (default: all sparse); first_k_dense_replace=N is accepted
      instead and makes the first N layers dense (DeepSeek). Dense layers use intermediate_size.
    - output_router_logits: return each sparse layer's router logits; with labels the loss then adds
      router_aux_loss_coef times the load-balancing loss. router_jitter_noise: Mixtral's multiplicative input noise
      while training."""

    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: Optional[int] = None
    router_scoring: str = "softmax"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    mlp_layer_types: Optional[list] = None
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    output_router_logits: bool = False

    def in_use(self, config) -> bool:
        return bool(self.num_local_experts)

    def checked(self, owner: str, config) -> "Moe":
        """Also fills in moe_intermediate_size (intermediate_size) and mlp_layer_types (from first_k_dense_replace,
        a keyword the config takes but does not hold)."""
        experts, dense_first = self.num_local_experts, config.first_k_dense_replace
        if self.mlp_layer_types is not None and not isinstance(self.mlp_layer_types, (list, tuple)):
            raise TypeError(
                f"{owner}: mlp_layer_types must be a list of 'dense' / 'sparse', got {self.mlp_layer_types!r}"
            )
        check_non_negative(owner, "0: every layer has a dense feed-forward", num_local_experts=experts)
        if experts == 0:
            if dense_first is not None or (self.mlp_layer_types is not None and "sparse" in self.mlp_layer_types):
                raise ValueError(
                    f"{owner}: first_k_dense_replace={dense_first!r} / mlp_layer_types={self.mlp_layer_types!r} ask "
                    "for sparse (MoE) layers but num_local_experts=0; set num_local_experts"
                )
            return self
        self._check_routing(owner)
        size = config.intermediate_size if self.moe_intermediate_size is None else self.moe_intermediate_size
        self._check_experts(owner, config, size)
        layer_types = _mlp_layer_types(owner, self.mlp_layer_types, config.num_hidden_layers, dense_first)
        return replace(self, moe_intermediate_size=size, mlp_layer_types=layer_types)

    def _check_routing(self, owner: str) -> None:
        experts, top_k, groups, best_groups = self.num_local_experts, self.num_experts_per_tok, self.n_group, self.topk_group
        check_positive(owner, num_experts_per_tok=top_k, n_group=groups, topk_group=best_groups)
        if top_k > experts:
            raise ValueError(f"{owner}: num_experts_per_tok={top_k} exceeds num_local_experts={experts}")
        check_divisible(owner, "num_local_experts", experts, "n_group", groups)
        if best_groups > groups:
            raise ValueError(f"{owner}: topk_group={best_groups} exceeds n_group={groups}")
        if groups > 1:
            per_group = experts // groups
            if per_group < 2:
                raise ValueError(
                    f"{owner}: grouped routing scores a group by its two best experts; n_group={groups} leaves "
                    f"{per_group} expert(s) per group of num_local_experts={experts}"
                )
            if top_k > best_groups * per_group:
                raise ValueError(
                    f"{owner}: num_experts_per_tok={top_k} exceeds the {best_groups * per_group} experts of the "
                    f"topk_group={best_groups} groups a token may use (num_local_experts={experts}, n_group={groups})"
                )
        check_choice(owner, "router_scoring", self.router_scoring, ROUTER_SCORINGS)
        if self.router_scoring == "topk_softmax" and (self.n_group != 1 or self.norm_topk_prob is not True):
            raise ValueError(
                f"{owner}: router_scoring='topk_softmax' (softmax over the k chosen logits, which sum to 1) takes no "
                f"expert groups and no renormalization switch; got n_group={self.n_group}, "
                f"norm_topk_prob={self.norm_topk_prob!r} (leave them at 1 and True)"
            )

    def _check_experts(self, owner: str, config, size: int) -> None:
        check_positive(owner, moe_intermediate_size=size)
        check_non_negative(owner, "0: no shared experts", shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        check_bool(owner, norm_topk_prob=self.norm_topk_prob, shared_expert_gate=self.shared_expert_gate,
                   output_router_logits=self.output_router_logits)
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError(f"{owner}: shared_expert_gate=True needs shared experts; shared_expert_intermediate_size=0")
        check_positive_number(owner, routed_scaling_factor=self.routed_scaling_factor)
        check_probability(owner, router_jitter_noise=self.router_jitter_noise)
        check_non_negative_number(owner, router_aux_loss_coef=self.router_aux_loss_coef)
        if not config.mlp_gated or config.mlp_bias:
            raise ValueError(
                f"{owner}: MoE experts are gated (SwiGLU) MLPs without biases; num_local_experts="
                f"{self.num_local_experts} needs mlp_gated=True and mlp_bias=False, got mlp_gated={config.mlp_gated}, "
                f"mlp_bias={config.mlp_bias}"
            )


def _mlp_layer_types(owner: str, mlp_layer_types, num_hidden_layers: int, first_k_dense_replace) -> list[str]:
    if mlp_layer_types is None:
        dense = 0 if first_k_dense_replace is None else first_k_dense_replace
        check_non_negative(owner, first_k_dense_replace=dense)
        if dense > num_hidden_layers:
            raise ValueError(f"{owner}: first_k_dense_replace={dense} exceeds num_hidden_layers={num_hidden_layers}")
        return ["dense"] * dense + ["sparse"] * (num_hidden_layers - dense)
    if first_k_dense_replace is not None:
        raise ValueError(f"{owner}: pass mlp_layer_types or first_k_dense_replace, not both")
    if not isinstance(mlp_layer_types, (list, tuple)) or len(mlp_layer_types) != num_hidden_layers:
        raise ValueError(
            f"{owner}: mlp_layer_types must list one of {list(MLP_LAYER_TYPES)} per layer "
            f"(num_hidden_layers={num_hidden_layers}), got {mlp_layer_types!r}"
        )
    for index, kind in enumerate(mlp_layer_types):
        if kind not in MLP_LAYER_TYPES:
            raise ValueError(f"{owner}: mlp_layer_types[{index}]={kind!r}; choose one of {list(MLP_LAYER_TYPES)}")
    return list(mlp_layer_types)



@dataclass(frozen=True)
class MoeSpec:
    """What one sparse feed-forward is built from (the causal config's MoE fields)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    scoring: str  # one of ROUTER_SCORINGS
    norm_topk_prob: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # 0: no shared experts
    shared_expert_gate: bool = False  # Qwen2-MoE: shared output scaled by sigmoid(linear(x))
    jitter_noise: float = 0.0  # Mixtral: inputs multiplied by U(1 - j, 1 + j) while training
    weights_on_input: bool = False  # Llama 4: expert(weight * x) instead of weight * expert(x)
    router_bias: bool = False  # GPT-OSS: the router's linear map has a bias


class TopKRouter(nn.Module):
    """Router logits -> (top-k expert indices, their weights). `weight` is [num_experts, hidden] (official name
    `gate.weight`), `bias` [num_experts] or None (GPT-OSS's `router.bias`); sigmoid routing also holds
    `e_score_correction_bias` (a buffer: it is not learned by gradient descent)."""

    def __init__(self, hidden_size: int, spec: MoeSpec):
        super().__init__()
        self.spec = spec
        # created float32 where official's DeepSeek-V3 router is (transformers_api.deepseek_router_float32)
        dtype = torch.float32 if spec.scoring == "sigmoid" and "gate.weight" in deepseek_router_float32() else None
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.router_bias else None
        if spec.scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts, dtype=dtype))
        else:
            self.e_score_correction_bias = None

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [T, hidden] -> (router_logits [T, E], top_k_index [T, k], top_k_weights [T, k]: fp32, in the
        logits' dtype for "topk_softmax")."""
        spec = self.spec
        logits, scores, choice_scores = self._scores(tokens)
        if spec.n_group > 1:
            choice_scores = self._keep_best_groups(choice_scores)
        top_k_index = torch.topk(choice_scores, spec.top_k, dim=-1).indices
        top_k_weights = scores.gather(-1, top_k_index)
        if spec.scoring == "topk_softmax":  # GPT-OSS: the chosen logits' softmax, which sums to 1 already
            top_k_weights = top_k_weights.softmax(dim=-1)
        elif spec.norm_topk_prob:
            # sigmoid scores need not sum to anything; the tiny constant is DeepSeek's guard against 0 / 0
            top_k_weights = top_k_weights / (top_k_weights.sum(dim=-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
        if spec.routed_scaling_factor != 1.0:
            top_k_weights = top_k_weights * spec.routed_scaling_factor
        return logits, top_k_index, top_k_weights

    def _scores(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits, the scores the weights are read from, the scores the choice ranks)."""
        spec = self.spec
        if spec.scoring == "sigmoid":  # DeepSeek-V3 routes in fp32 whatever the model's dtype
            logits = F.linear(tokens.float(), self.weight.float(), None if self.bias is None else self.bias.float())
            scores = logits.sigmoid()
            return logits, scores, scores + self.e_score_correction_bias
        logits = F.linear(tokens, self.weight, self.bias)
        if spec.scoring == "topk_sigmoid":  # Llama 4: the logits choose, their sigmoid weighs
            return logits, logits.float().sigmoid(), logits
        scores = logits.float().softmax(dim=-1) if spec.scoring == "softmax" else logits
        return logits, scores, scores

    def _keep_best_groups(self, choice_scores: torch.Tensor) -> torch.Tensor:
        """Experts outside the topk_group best groups get -inf, so top-k never picks them."""
        spec = self.spec
        grouped = choice_scores.unflatten(-1, (spec.n_group, spec.num_experts // spec.n_group))
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        best_groups = group_scores.topk(spec.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best_groups, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


def _expert_kind(expert: nn.Module) -> str:
    """"swiglu" for a bias-free gated SiLU feed-forward (Mixtral's, Qwen's, DeepSeek's experts), else its class."""
    activation = type(getattr(expert, "act_fn", None)).__name__
    gated_silu = hasattr(expert, "gate_proj") and activation in ("SiLU", "SiLUActivation")
    if gated_silu and type(expert).__name__ == "GatedFeedForward" and expert.gate_proj.bias is None:
        return "swiglu"
    return f"{type(expert).__name__} experts"


class SparseMoeFeedForward(nn.Module):
    """gate (the router), experts.0 .. experts.{E-1}, and optionally shared_experts (one MLP every token goes
    through) with Qwen2-MoE's shared_expert_gate. make_mlp(intermediate_size) builds one expert: the block's own
    SwiGLU feed-forward, so experts carry Llama's projection names (gate_proj, up_proj, down_proj)."""

    def __init__(self, hidden_size: int, spec: MoeSpec, make_mlp: Callable[[int], nn.Module]):
        super().__init__()
        self.spec = spec
        self.gate = TopKRouter(hidden_size, spec)
        self.experts = nn.ModuleList(make_mlp(spec.intermediate_size) for _ in range(spec.num_experts))
        self.experts_kind = _expert_kind(self.experts[0])  # what an engine's expert runner must compute
        self.shared_experts = None
        self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_experts = make_mlp(spec.shared_intermediate_size)
            if spec.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, S, hidden] -> [B, S, hidden]. The router's logits ([B * S, E]) are the first output of `gate`, where
        output_router_logits reads them."""
        if self.training and self.spec.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.spec.jitter_noise, 1.0 + self.spec.jitter_noise)
            hidden_states = hidden_states * noise
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        _router_logits, top_k_index, top_k_weights = self.gate(tokens)
        if not isinstance(self.experts, nn.ModuleList):
            output = self._replaced_experts(tokens, top_k_index, top_k_weights)
        elif torch.compiler.is_compiling() and tokens.shape[0] <= COMPILED_DENSE_MAX_TOKENS:
            output = self._every_expert_on_every_token(tokens, top_k_index, top_k_weights)
        else:
            output = self._each_expert_on_its_tokens(tokens, top_k_index, top_k_weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            output = output + shared
        return output.view_as(hidden_states)

    def _replaced_experts(self, tokens, top_k_index, top_k_weights) -> torch.Tensor:
        """An engine that replaced the experts by its own runner (vLLM's Transformers backend, where its fuser takes
        the experts but not the block, as with shared experts) calls it as transformers' experts modules are called:
        experts(tokens, top_k_index, top_k_weights) -> the weighted sum of the chosen experts' outputs."""
        if self.spec.weights_on_input or self.experts_kind != "swiglu":
            raise ValueError(
                f"this block's experts were replaced by {type(self.experts).__name__}, which computes SwiGLU experts "
                "without biases (silu(gate) * up) and weighs their outputs; these are "
                f"{'weighted on their inputs (Llama 4)' if self.spec.weights_on_input else self.experts_kind}, so it "
                "would compute other numbers. Serve the official checkpoint (python -m conversion --reverse)"
            )
        return self.experts(tokens, top_k_index, top_k_weights)

    def _each_expert_on_its_tokens(self, tokens, top_k_index, top_k_weights) -> torch.Tensor:
        """The reading: each expert takes the tokens that chose it, and adds its weighted output to theirs."""
        output = torch.zeros_like(tokens)
        for expert_index, expert in enumerate(self.experts):
            # the tokens that chose this expert, and in which of their k slots (a token picks an expert once)
            token_index, slot = torch.where(top_k_index == expert_index)
            # While training, an expert no token chose still runs (on no rows): its gradient is then zero, as the
            # slice of official's 3-D expert parameter is, not None. With None, AdamW skipped its momentum and weight
            # decay, and DDP / FSDP, which reduce every parameter's gradient, stopped.
            if token_index.numel() == 0 and not torch.is_grad_enabled():
                continue
            weights = top_k_weights[token_index, slot, None]
            if self.spec.weights_on_input:  # Llama 4: the weight (in the model's dtype) scales the expert's input
                expert_out = expert(tokens[token_index] * weights.to(tokens.dtype))
            else:
                expert_out = expert(tokens[token_index]) * weights
            output.index_add_(0, token_index, expert_out.to(output.dtype))
        return output

    def _every_expert_on_every_token(self, tokens, top_k_index, top_k_weights) -> torch.Tensor:
        """The same sums, in the same order, with shapes that do not depend on the routing, which a compiled graph
        (and a CUDA graph replaying it) needs: every expert runs on every token, and what it gives a token that did
        not choose it is dropped. It reads each expert's weights once; it multiplies E rows per token, not k."""
        output = torch.zeros_like(tokens)
        for expert_index, expert in enumerate(self.experts):
            chosen = top_k_index == expert_index  # [T, k]: at most one slot of a token is this expert
            weights = (top_k_weights * chosen).sum(dim=-1, keepdim=True)
            if self.spec.weights_on_input:
                expert_out = expert(tokens * weights.to(tokens.dtype))
            else:
                expert_out = expert(tokens) * weights
            output = output + torch.where(chosen.any(dim=-1, keepdim=True), expert_out.to(output.dtype), 0.0)
        return output


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, attention_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4-6) over all MoE layers, as transformers
    computes it for Mixtral and Qwen-MoE: E * sum_e f_e * P_e, where f_e is the share of the top-k assignments that
    went to expert e and P_e the mean router probability of e, both over every (layer, real token). A uniform
    router gives top_k (the minimum for a given k).

    router_logits: one [tokens, E] tensor per MoE layer; attention_mask: [batch, seq] with batch * seq = tokens
    (0 = padding, excluded), or None."""
    device = router_logits[0].device
    assignments = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)
    real = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = logits.float().softmax(dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices  # [tokens, k]
        weight = torch.ones(chosen.shape[0], device=device) if real is None else real
        assignments = assignments.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        probabilities = probabilities + (probs * weight[:, None]).sum(dim=0)
        rows = rows + weight.sum()
    return num_experts * torch.sum((assignments / rows) * (probabilities / rows))


__all__ = ["Moe", "MoeSpec", "TopKRouter", "SparseMoeFeedForward", "load_balancing_loss", "ROUTER_SCORINGS"]

"""The causal config's optional mechanisms, one table each: its fields with the values that mean "off", when it is
in use, its checks and what its fields mean.

A TinyCausalConfig holds a mechanism's fields (and its config.json lists them) only while the mechanism is in use,
so a dense model has no field a tool could read as "this is a Mixture-of-Experts model" (TRL turns router losses on
when a config has output_router_logits). Code reads a mechanism through the config's view of its table, typed and
whether held or not: `config.moe.num_local_experts` is 0 on a dense model, `config.sinks.attention_sinks` False.
The Mixture-of-Experts table lives with the experts (moe.py's Moe).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import Generic, Optional, TypeVar

from .rope import uses_longrope
from .validation import check_bool, check_choice, check_non_negative, check_non_negative_number, check_positive
from .validation import check_positive_number

QK_NORM_TYPES = ("head", "projection", "l2")


@dataclass(frozen=True)
class Mechanism(ABC):
    """A table: its dataclass fields are config fields, their defaults the values a config that does not use the
    mechanism reads. `config` below is the config (or, while it is built, a namespace of its checked fields and of
    every table)."""

    @abstractmethod
    def in_use(self, config) -> bool:
        """Whether the config uses the mechanism (then it holds every field of this table)."""

    def checked(self, owner: str, config) -> "Mechanism":
        """This table with a bad value refused (an error naming the field and the value) and what its fields leave
        open filled in."""
        return self

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in fields(cls))

    @classmethod
    def taken_from(cls, kwargs: dict) -> "Mechanism":
        """The table of a config's keyword arguments; its fields are removed from them."""
        return cls(**{name: kwargs.pop(name) for name in cls.field_names() if name in kwargs})

    def values(self) -> dict:
        return {name: getattr(self, name) for name in self.field_names()}


TableT = TypeVar("TableT", bound=Mechanism)


class MechanismView(Generic[TableT]):
    """A config attribute that reads one table (`config.moe` -> Moe); the fields are set by their own names."""

    def __init__(self, table: type[TableT]):
        self.table = table
        self.field_names = table.field_names()  # once: torch.compile cannot trace dataclasses.fields

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, config, owner=None) -> TableT:
        """The table of the fields the config holds, defaults for the others."""
        if config is None:
            return self
        held = config.__dict__
        return self.table(**{name: held[name] for name in self.field_names if name in held})

    def __set__(self, config, value) -> None:
        raise AttributeError(f"{type(config).__name__}.{self.name} is a view of the fields {list(self.field_names)}; "
                             "set those")


def mechanism_views(config_class: type) -> dict[str, MechanismView]:
    """name -> view of every table a config class declares, in the order its checks run."""
    return {name: value for name, value in vars(config_class).items() if isinstance(value, MechanismView)}


@dataclass(frozen=True)
class Mla(Mechanism):
    """Multi-head Latent Attention (DeepSeek-V2/V3; mla.py), on when kv_lora_rank is set: q_lora_rank (None: no
    query compression), qk_nope_head_dim + qk_rope_head_dim per query/key head (head_dim is their sum), v_head_dim;
    the cache holds the kv_lora_rank-wide latent and the shared rotary key. mla_absorb: attend over the latent with
    the up-projections folded into queries and outputs (same result, no expanded keys)."""

    kv_lora_rank: Optional[int] = None
    q_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    mla_absorb: bool = False

    def in_use(self, config) -> bool:
        return self.kv_lora_rank is not None

    def head_dim(self) -> int:
        """The head_dim of queries and (expanded) keys."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def checked(self, owner: str, config) -> "Mla":
        if not self.in_use(config):
            return self
        check_positive(owner, kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                       qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
        if self.q_lora_rank is not None:
            check_positive(owner, q_lora_rank=self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{owner}: qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
        check_bool(owner, mla_absorb=self.mla_absorb)
        if config.head_dim is not None and config.head_dim != self.head_dim():
            raise ValueError(
                f"{owner}: with MLA (kv_lora_rank={self.kv_lora_rank}) head_dim is qk_nope_head_dim + "
                f"qk_rope_head_dim = {self.head_dim()}; got head_dim={config.head_dim} (leave it unset)"
            )
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if kv_heads is not None and kv_heads != heads:
            raise ValueError(
                f"{owner}: MLA expands per-head keys and values from its latent; num_key_value_heads={kv_heads} must "
                f"equal num_attention_heads={heads} (or be unset)"
            )
        conflicts = {
            name: getattr(config, name)
            for name, off in (("position_embedding_type", "rope"), ("qk_norm", False), ("sliding_window", None),
                              ("attention_output_bias", None), ("query_pre_attn_scalar", None))
            if getattr(config, name) != off
        }
        if conflicts:
            raise ValueError(
                f"{owner}: MLA (kv_lora_rank={self.kv_lora_rank}) has rotary keys, no q/k norm, no sliding window, "
                f"one attention_bias and the default scale; got {conflicts}"
            )
        return self


@dataclass(frozen=True)
class Alibi(Mechanism):
    """ALiBi (BLOOM, MPT; masks.alibi_slopes), on with position_embedding_type "alibi": no position embeddings;
    each head adds -m_h * (i - j) to its scores, slopes m_h from alibi_bias_max."""

    alibi_bias_max: float = 8.0

    def in_use(self, config) -> bool:
        return config.position_embedding_type == "alibi"

    def checked(self, owner: str, config) -> "Alibi":
        check_positive_number(owner, alibi_bias_max=self.alibi_bias_max)
        return self


@dataclass(frozen=True)
class Nope(Mechanism):
    """nope_layers: indices of layers without rotary positions (NoPE: SmolLM3 every 4th layer, Llama 4 too);
    stored sorted."""

    nope_layers: tuple = ()

    def in_use(self, config) -> bool:
        return bool(self.nope_layers)

    def checked(self, owner: str, config) -> "Nope":
        nope, layers = self.nope_layers, config.num_hidden_layers
        if not isinstance(nope, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in nope):
            raise TypeError(f"{owner}: nope_layers must be a list of layer indices, got {nope!r}")
        outside = [i for i in nope if not 0 <= i < layers]
        if outside or len(set(nope)) != len(nope):
            raise ValueError(
                f"{owner}: nope_layers={list(nope)} must list distinct layer indices 0 .. {layers - 1} "
                f"(num_hidden_layers={layers}); {'outside: ' + str(outside) if outside else 'repeated indices'}"
            )
        if nope and (config.position_embedding_type != "rope" or config.mla.in_use(config)):
            raise ValueError(
                f"{owner}: nope_layers={list(nope)} are the layers of a rotary model that do not rotate; needs "
                f"position_embedding_type='rope' (got {config.position_embedding_type!r}) and no MLA "
                f"(kv_lora_rank={config.mla.kv_lora_rank!r})"
            )
        return replace(self, nope_layers=sorted(nope))


def _needs(owner: str, name: str, value, requirement: str, met: bool) -> None:
    """A switch that is on only with another field's mechanism."""
    if not met:
        raise ValueError(f"{owner}: {name}={value!r} needs {requirement}")


@dataclass(frozen=True)
class QkNormPlacement(Mechanism):
    """qk_norm_type, where qk_norm acts: "head" (each head before RoPE, weights of head_dim: Qwen3, Gemma 3),
    "projection" (the whole q / k projection before the heads split, weights of heads * head_dim: OLMo 2), "l2"
    (each head after RoPE, no weight, on rotary layers only: Llama 4's use_qk_norm)."""

    qk_norm_type: str = "head"

    def in_use(self, config) -> bool:
        return self.qk_norm_type != "head"

    def checked(self, owner: str, config) -> "QkNormPlacement":
        check_choice(owner, "qk_norm_type", self.qk_norm_type, QK_NORM_TYPES)
        if self.in_use(config):
            _needs(owner, "qk_norm_type", self.qk_norm_type, "qk_norm=True", config.qk_norm)
        return self


@dataclass(frozen=True)
class NormLayout(Mechanism):
    """pre_norms=False: no norm before each sublayer; with sandwich_norms the layer is OLMo 2's
    h = x + norm(attn(x)), out = h + norm(mlp(h))."""

    pre_norms: bool = True

    def in_use(self, config) -> bool:
        return self.pre_norms is not True

    def checked(self, owner: str, config) -> "NormLayout":
        check_bool(owner, pre_norms=self.pre_norms)
        if not self.pre_norms:
            _needs(owner, "pre_norms", self.pre_norms, "sandwich_norms=True (norms on the sublayer outputs)",
                   config.sandwich_norms)
        return self


@dataclass(frozen=True)
class HalfPrecisionRounding(Mechanism):
    """Where a bf16 / fp16 model rounds (in float32 these change nothing). norm_product_float32: the RMSNorm
    multiplies its weight into the float32 normalized states and casts after (OLMo 2, GPT-OSS), where Llama casts
    first. rope_float32: queries and keys are rotated with float32 cos / sin and cast back (OLMo 2), where Llama's
    cos / sin are in the model's dtype."""

    norm_product_float32: bool = False
    rope_float32: bool = False

    def in_use(self, config) -> bool:
        return self.norm_product_float32 is not False or self.rope_float32 is not False

    def checked(self, owner: str, config) -> "HalfPrecisionRounding":
        check_bool(owner, norm_product_float32=self.norm_product_float32, rope_float32=self.rope_float32)
        if self.norm_product_float32:
            _needs(owner, "norm_product_float32", True, "norm_type='rmsnorm'", config.norm_type == "rmsnorm")
        return self


@dataclass(frozen=True)
class LongropeCache(Mechanism):
    """longrope_cache_kept: generation keeps the keys it cached with the short factors once the sequence passes
    original_max_position_embeddings (official Llama, Qwen2, Gemma 3 with a longrope config: the rotary module
    switches factors, the cache stays); False (Phi-3's): that step drops the cache and recomputes every key with the
    long factors."""

    longrope_cache_kept: bool = False

    def in_use(self, config) -> bool:
        return self.longrope_cache_kept is not False

    def checked(self, owner: str, config) -> "LongropeCache":
        check_bool(owner, longrope_cache_kept=self.longrope_cache_kept)
        if self.longrope_cache_kept:
            longrope = uses_longrope(config.rope_parameters) or uses_longrope(getattr(config, "rope_scaling", None))
            _needs(owner, "longrope_cache_kept", True, "a longrope rope_parameters", longrope)
        return self


@dataclass(frozen=True)
class PaddingRow(Mechanism):
    """use_padding_idx=False: the token embedding has no padding row (pad_token_id's row trains like any other),
    as official GPT-2 and MPT; True (Llama and most others; the seq2seq config's field of the same name):
    nn.Embedding(padding_idx=pad_token_id)."""

    use_padding_idx: bool = True

    def in_use(self, config) -> bool:
        return self.use_padding_idx is not True

    def checked(self, owner: str, config) -> "PaddingRow":
        check_bool(owner, use_padding_idx=self.use_padding_idx)
        return self


@dataclass(frozen=True)
class AttnTemperature(Mechanism):
    """attn_temperature_tuning (Llama 4): on NoPE layers the query of cache index t is scaled by
    1 + attn_scale * log(1 + floor((t + 1) / floor_scale))."""

    attn_temperature_tuning: bool = False
    floor_scale: float = 8192
    attn_scale: float = 0.1

    def in_use(self, config) -> bool:
        return self.attn_temperature_tuning is not False

    def checked(self, owner: str, config) -> "AttnTemperature":
        check_bool(owner, attn_temperature_tuning=self.attn_temperature_tuning)
        if self.attn_temperature_tuning:
            _needs(owner, "attn_temperature_tuning", True, "NoPE layers (nope_layers)", bool(config.nope.nope_layers))
            check_positive_number(owner, floor_scale=self.floor_scale)
            check_non_negative_number(owner, attn_scale=self.attn_scale)
        return self


@dataclass(frozen=True)
class RouterInputWeights(Mechanism):
    """apply_router_weight_on_input (Llama 4): each expert gets its tokens already multiplied by their router
    weight."""

    apply_router_weight_on_input: bool = False

    def in_use(self, config) -> bool:
        return self.apply_router_weight_on_input is not False

    def checked(self, owner: str, config) -> "RouterInputWeights":
        check_bool(owner, apply_router_weight_on_input=self.apply_router_weight_on_input)
        if self.apply_router_weight_on_input:
            _needs(owner, "apply_router_weight_on_input", True, "MoE layers (num_local_experts)",
                   bool(config.moe.num_local_experts))
        return self


@dataclass(frozen=True)
class ChunkedAttention(Mechanism):
    """layer_types "chunked_attention" with attention_chunk_size C (Llama 4's local layers): a query sees the keys
    of its own chunk of C tokens (counted from the row's first real token), causally."""

    attention_chunk_size: Optional[int] = None

    def in_use(self, config) -> bool:
        return self.attention_chunk_size is not None

    def checked(self, owner: str, config) -> "ChunkedAttention":
        chunk, layer_types = self.attention_chunk_size, config.layer_types
        if chunk is not None:
            check_positive(owner, attention_chunk_size=chunk)
        chunked = "chunked_attention" in layer_types
        if chunked != (chunk is not None):
            raise ValueError(
                f"{owner}: 'chunked_attention' layers and attention_chunk_size go together; got attention_chunk_size="
                f"{chunk!r} and {layer_types.count('chunked_attention')} chunked_attention layer(s) in layer_types"
            )
        if chunked and "sliding_attention" in layer_types:
            raise ValueError(
                f"{owner}: layer_types mixes 'sliding_attention' and 'chunked_attention'; transformers' caches before "
                "5.2x keep one window for every local layer, so a model has one kind of local attention"
            )
        return self


@dataclass(frozen=True)
class AttentionSinks(Mechanism):
    """attention_sinks (GPT-OSS): a learned logit per head (`self_attn.sinks`) in every query's softmax
    denominator, attached to no value (attention.py's backends)."""

    attention_sinks: bool = False

    def in_use(self, config) -> bool:
        return bool(self.attention_sinks)

    def checked(self, owner: str, config) -> "AttentionSinks":
        check_bool(owner, attention_sinks=self.attention_sinks)
        if self.attention_sinks and config.mla.in_use(config):
            raise ValueError(f"{owner}: attention_sinks=True is not supported with MLA "
                             f"(kv_lora_rank={config.mla.kv_lora_rank})")
        return self


@dataclass(frozen=True)
class MoeBiases(Mechanism):
    """router_bias / expert_bias (GPT-OSS): a bias on the router (`mlp.gate.bias`) / on each expert's
    projections."""

    router_bias: bool = False
    expert_bias: bool = False

    def in_use(self, config) -> bool:
        return bool(self.router_bias or self.expert_bias)

    def checked(self, owner: str, config) -> "MoeBiases":
        check_bool(owner, router_bias=self.router_bias, expert_bias=self.expert_bias)
        biased = [name for name in ("router_bias", "expert_bias") if getattr(self, name)]
        if biased and not config.moe.num_local_experts:
            raise ValueError(f"{owner}: {'/'.join(biased)}=True ask for Mixture-of-Experts biases but num_local_experts=0")
        return self


@dataclass(frozen=True)
class ClampedSwiglu(Mechanism):
    """swiglu_limit (None: off) and swiglu_alpha (GPT-OSS): every gated feed-forward is the clamped SwiGLU,
    down((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)), g = clamp(gate, max=limit) (layers.py)."""

    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.702

    def in_use(self, config) -> bool:
        return self.swiglu_limit is not None

    def checked(self, owner: str, config) -> "ClampedSwiglu":
        if self.swiglu_limit is not None:
            check_positive_number(owner, swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
            if not config.mlp_gated:
                raise ValueError(f"{owner}: swiglu_limit={self.swiglu_limit} clamps a gated feed-forward; "
                                 "set mlp_gated=True")
        return self


@dataclass(frozen=True)
class Mtp(Mechanism):
    """Multi-Token Prediction (DeepSeek-V3; mtp.py): num_nextn_predict_layers modules predicting tokens 2 .. D + 1
    ahead, trained with weight mtp_loss_weight (lambda) and used by generate(use_mtp=True) to draft tokens."""

    num_nextn_predict_layers: int = 0
    mtp_loss_weight: float = 0.3

    def in_use(self, config) -> bool:
        return bool(self.num_nextn_predict_layers)

    def checked(self, owner: str, config) -> "Mtp":
        depth = self.num_nextn_predict_layers
        check_non_negative(owner, "0: no Multi-Token Prediction modules", num_nextn_predict_layers=depth)
        check_non_negative_number(owner, mtp_loss_weight=self.mtp_loss_weight)
        if depth and config.position_embedding_type != "rope":
            raise ValueError(
                f"{owner}: Multi-Token Prediction modules (num_nextn_predict_layers={depth}) rotate with RoPE; "
                f"position_embedding_type={config.position_embedding_type!r} is not supported with them"
            )
        if depth and "sliding_attention" in config.layer_types:
            raise ValueError(
                f"{owner}: Multi-Token Prediction modules (num_nextn_predict_layers={depth}) attend with full "
                "attention; a model with sliding_attention layers is not supported"
            )
        return self

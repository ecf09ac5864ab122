"""Phi-3 / Phi-4-mini (transformers `model_type: phi3`) <-> hf_tiny causal LM.

    python -m conversion [phi3] SRC DST              official Phi-3 folder or phi3 GGUF -> hf_tiny folder
    python -m conversion [phi3] SRC DST --reverse    hf_tiny causal folder -> Phi-3 folder

A Phi-3 block is the Llama block; what differs is named here:
  * `self_attn.qkv_proj` holds q, k and v stacked on the output dimension (sizes heads x head_dim, then
    kv_heads x head_dim twice), `mlp.gate_up_proj` the gate and up projections (gate first): split / joined by
    transforms, bit for bit;
  * RoPE may rotate only part of each head (`partial_rotary_factor`, Phi-4-mini) and may be "longrope" (Phi-3
    128k: per-frequency short / long factors); both are rope options of the causal family;
  * `resid_pdrop` is the residual dropout (hidden_dropout); official Phi-3 never applies `embd_pdrop`, so it is
    not carried.
A folder converted back with --reverse and no family named goes to Phi-3 only when it needs Phi-3 (longrope or
partial rotary); `python -m conversion phi3 SRC DST --reverse` writes Phi-3 for any config Phi-3 can hold.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import ConversionError
from .keymap import KeyMap, Rule, Transform
from .causal import IGNORED_BUFFERS, OUR_CLASSES, CausalFamily, build_causal_config, class_for_architecture, detect_source
from .pipeline import Plan, ReversePlan, Source, entry_points
from .readers import official_config
from .writer import drop_tied_copies

OFFICIAL_CLASSES = {
    "TinyCausalForCausalLM": "Phi3ForCausalLM",
    "TinyCausalForSequenceClassification": "Phi3ForSequenceClassification",
    "TinyCausalModel": "Phi3Model",
}
PER_LAYER = {  # official module -> ours (weights only: Phi-3 has no biases)
    "self_attn.o_proj": "self_attn.o_proj",
    "mlp.down_proj": "mlp.down_proj",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
}
# TinyCausalConfig fields Phi-3 fixes (the reverse direction requires them)
PHI3_STRUCTURE = dict(
    position_embedding_type="rope", norm_type="rmsnorm", mlp_gated=True, attention_bias=False,
    attention_output_bias=None, mlp_bias=False, qk_norm=False, rms_norm_unit_offset=False, scale_embeddings=False,
    sandwich_norms=False, query_pre_attn_scalar=None, final_logit_softcapping=None, embedding_dropout=0.0,
)


def split_rows(name: str, sizes: tuple[int, ...]) -> Transform:
    """One weight whose output rows stack several projections <-> the projections, split in order."""

    def split(weight: torch.Tensor):
        if weight.shape[0] != sum(sizes):
            raise ConversionError(
                f"{name} has shape {tuple(weight.shape)}: its {weight.shape[0]} rows must be {' + '.join(map(str, sizes))}"
                f" = {sum(sizes)}"
            )
        return tuple(part.contiguous() for part in weight.split(sizes, dim=0))

    return Transform(f"split_rows({name}: {', '.join(map(str, sizes))})", split, lambda *parts: torch.cat(parts, dim=0))


def key_map(config, class_name: str = "TinyCausalForCausalLM") -> KeyMap:
    if class_name not in OFFICIAL_CLASSES:
        raise ConversionError(f"unsupported hf_tiny class {class_name!r}; supported: {', '.join(OFFICIAL_CLASSES)}")
    p = OUR_CLASSES[class_name][2]
    layer = f"{p}layers.{{i}}."
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    embed = f"{p}embed_tokens.weight"
    tied = class_name == "TinyCausalForCausalLM" and config.tie_word_embeddings
    rules: list = [
        Rule(embed, (embed, "lm_head.weight") if tied else embed),
        Rule(f"{layer}self_attn.qkv_proj.weight",
             tuple(f"{layer}self_attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj")),
             split_rows("qkv_proj.weight", (q_rows, kv_rows, kv_rows))),
        Rule(f"{layer}mlp.gate_up_proj.weight", (f"{layer}mlp.gate_proj.weight", f"{layer}mlp.up_proj.weight"),
             split_rows("gate_up_proj.weight", (config.intermediate_size, config.intermediate_size))),
        (f"{p}norm.weight",) * 2,
    ]
    rules += [(f"{layer}{official}.weight", f"{layer}{ours}.weight") for official, ours in PER_LAYER.items()]
    if class_name == "TinyCausalForCausalLM" and not config.tie_word_embeddings:
        rules.append(("lm_head.weight", "lm_head.weight"))
    if class_name == "TinyCausalForSequenceClassification":
        rules.append(("score.weight", "score.weight"))
    return KeyMap(rules, ignore=IGNORED_BUFFERS)


def causal_config_from_phi3(official, *, src):
    rope = dict(official.rope_parameters or {})
    if rope.get("rope_type") == "longrope":
        rope.setdefault("original_max_position_embeddings", official.original_max_position_embeddings)
    values = dict(
        PHI3_STRUCTURE,
        vocab_size=official.vocab_size,
        hidden_size=official.hidden_size,
        intermediate_size=official.intermediate_size,
        num_hidden_layers=official.num_hidden_layers,
        num_attention_heads=official.num_attention_heads,
        num_key_value_heads=official.num_key_value_heads,
        head_dim=official.hidden_size // official.num_attention_heads,
        hidden_act=official.hidden_act,
        max_position_embeddings=official.max_position_embeddings,
        initializer_range=official.initializer_range,
        rms_norm_eps=official.rms_norm_eps,
        rope_parameters=rope,
        sliding_window=official.sliding_window,  # every layer, as Mistral
        attention_dropout=official.attention_dropout,
        hidden_dropout=official.resid_pdrop,
        tie_word_embeddings=official.tie_word_embeddings,
        pad_token_id=official.pad_token_id,
        bos_token_id=official.bos_token_id,
        eos_token_id=official.eos_token_id,
    )
    if values["pad_token_id"] is not None and not 0 <= values["pad_token_id"] < values["vocab_size"]:
        values["pad_token_id"] = None
    return build_causal_config(values, official, src=src)


def phi3_config_from_causal(config, official_class: str):
    import transformers

    differing = {k: getattr(config, k) for k, v in PHI3_STRUCTURE.items() if getattr(config, k) != v}
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        differing["head_dim"] = config.head_dim
    if set(config.rope_parameters) != set(config.rope_parameters_for("full_attention")):
        differing["rope_parameters"] = "keyed by layer type"
    expected_types = ["sliding_attention" if config.sliding_window else "full_attention"] * config.num_hidden_layers
    if config.layer_types != expected_types:
        differing["layer_types"] = config.layer_types
    if differing:
        raise ConversionError(f"Phi-3 cannot hold this hf_tiny config: it differs from Phi-3's structure in {differing}")
    rope = dict(config.rope_parameters)
    values = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps, rope_parameters=rope, sliding_window=config.sliding_window,
        attention_dropout=config.attention_dropout, resid_pdrop=config.hidden_dropout,
        tie_word_embeddings=config.tie_word_embeddings, pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, architectures=[official_class],
    )
    if "original_max_position_embeddings" in rope:
        values["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if config.id2label is not None and official_class == "Phi3ForSequenceClassification":
        values.update(id2label=config.id2label, label2id=config.label2id, problem_type=config.problem_type)
    return transformers.Phi3Config(**values)


def needs_phi3(config) -> bool:
    """Only Phi-3 among the official causal classes holds longrope or a partial rotary factor."""
    rope = config.rope_parameters_for("full_attention")
    return rope["rope_type"] == "longrope" or rope.get("partial_rotary_factor", 1.0) != 1.0


class Phi3Family(CausalFamily):
    name = "phi3"
    model_types = ("phi3",)
    gguf_architectures = ("phi3",)
    card_family = "hf_tiny_causal (Llama-style decoder; Phi-3's fused projections split)"
    tags = ("phi3", "causal-lm", "text-generation")

    def read(self, src: Path) -> Source:
        kind, path = detect_source(src)
        if kind == "gguf":
            return self.read_gguf(path)
        if kind != "hf":
            raise ConversionError(f"{src} is not a Phi-3 checkpoint: expected a Hugging Face folder or a phi3 GGUF")
        source = super().read(path)
        source.description = f"the Hugging Face phi3 folder `{path.resolve().name}`"
        return source

    def plan(self, source: Source) -> Plan:
        official = official_config(source.raw_config, src=source.path)
        config = causal_config_from_phi3(official, src=source.path)
        class_name = "TinyCausalForCausalLM" if source.kind == "gguf" else class_for_architecture(
            source.raw_config.get("architectures"), OFFICIAL_CLASSES, "Phi3ForCausalLM", src=source.path)
        state = source.state
        if class_name == "TinyCausalForCausalLM" and config.tie_word_embeddings:
            state = drop_tied_copies(state, "model.embed_tokens.weight", ["lm_head.weight"], src=source.path)
        notes = []
        if official.embd_pdrop:
            notes.append(f"embd_pdrop={official.embd_pdrop} is not carried: official Phi-3 never applies it.")
        return Plan(config, class_name, OFFICIAL_CLASSES[class_name], key_map(config, class_name),
                    config.num_hidden_layers, state, notes=notes)

    def reverse(self, config, our_class: str, src: Path) -> ReversePlan:
        official_class = OFFICIAL_CLASSES[our_class]
        return ReversePlan(official_class, phi3_config_from_causal(config, official_class), key_map(config, our_class),
                           config.num_hidden_layers)


FAMILY = Phi3Family()
convert, convert_back = entry_points(FAMILY)

"""Llama-family checkpoints <-> hf_tiny causal LM (`model_type: hf_tiny_causal`).

    python -m conversion llama SRC DST              -> hf_tiny folder
    python -m conversion llama SRC DST --reverse    hf_tiny causal folder -> the official folder of the type its
                                                    fields name (llama_configs.official_family)

SRC may be
  (a) a Hugging Face folder of one of HF_MODEL_TYPES (safetensors, sharded, or .bin read with weights_only): each
      type is a table of what it changes in the Llama block (llama_configs.OFFICIAL_TYPES, conversion/
      causal_variant.py: its norms' names, renamed or fused tensors, config fields), strictly checked; parity is
      measured against the source's own model type;
  (b) a .gguf file of one of GGUF_ARCHITECTURES (or a folder holding exactly one): transformers' own GGUF reader
      dequantizes it (and un-permutes Llama's q/k, removes Gemma's +1 on norms), exactly what
      `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` does; its tokenizer (with the chat template) is
      rebuilt from the GGUF and saved beside the weights;
  (c) Meta's original layout: consolidated.*.pth (one per model-parallel shard) + params.json (+ tokenizer.model).
      Meta's q/k rows interleave the two halves of each rotary pair; transformers' Llama expects them split into
      halves (rotate_half), hence the RoPE permutation below (the `permute` of transformers'
      convert_llama_weights_to_hf.py) and its inverse.
Parity with the official transformers model is measured while converting and written into the model card; an
fp32 row above its tolerance, or any row that is not finite, fails the conversion (DST is then left untouched).
"""

from __future__ import annotations

from pathlib import Path

from hf_tiny.configuration_causal import field_value

from . import deepseek, gpt_oss
from .causal import IGNORED_BUFFERS, OUR_CLASSES, CausalFamily, check_layer_types, detect_source
from .causal_variant import CausalVariant
from .errors import ConversionError
from .keymap import KeyMap, Rule
from .llama_configs import OFFICIAL_TYPES, causal_config_from_official, official_config_from_causal, official_family
from .meta_llama import meta_config, meta_key_map, meta_official_model, read_meta_source
from .pipeline import Plan, ReversePlan, Source, entry_points
from .readers import official_config, source_name
from .streamed import Streamed
from .writer import drop_tied_copies

HF_MODEL_TYPES = tuple(OFFICIAL_TYPES)
# GGUF general.architecture values read (transformers' GGUF loader turns "gemma3" into model_type gemma3_text)
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

# Per layer: the Llama names, shared by the official classes and hf_tiny.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------------------------------------------
# Key maps
# ----------------------------------------------------------------------------------------------------------------


def key_map(config, class_name: str = "TinyCausalForCausalLM", *, rope_interleave: bool = True,
            model_type: str | None = None) -> KeyMap:
    """Official <-> hf_tiny key map of one class, in the names of the official type model_type (by default the one
    official_family picks for the config); biases follow the config. rope_interleave: an MLA (DeepSeek)
    checkpoint's rotary rows are interleaved pairs."""
    if class_name not in OUR_CLASSES:
        raise ConversionError(f"unsupported hf_tiny class {class_name!r}; supported: {', '.join(OUR_CLASSES)}")
    variant = OFFICIAL_TYPES[model_type or official_family(config)]
    p = OUR_CLASSES[class_name][2]
    layer = f"{p}layers.{{i}}."
    rules: list = []
    embed = f"{p}embed_tokens.weight"
    mtp_layers = range(config.mtp_depth()) if class_name == "TinyCausalForCausalLM" else range(0)
    # MTP modules' copies of the embedding and the head (DeepSeek stores one per module; the model shares them)
    embed_copies = tuple(f"model.layers.{config.num_hidden_layers + k}.embed_tokens.weight" for k in mtp_layers)
    head_copies = tuple(f"model.layers.{config.num_hidden_layers + k}.shared_head.head.weight" for k in mtp_layers)
    if class_name == "TinyCausalForCausalLM" and config.tie_word_embeddings:
        rules.append(Rule((embed, *embed_copies, *head_copies), (embed, "lm_head.weight")))
    else:
        rules.append(Rule((embed, *embed_copies), embed))
    if config.moe_spec() is not None:  # dense and sparse layers differ: rules per layer index
        for i, kind in enumerate(config.mlp_layer_types):
            rules += _layer_rules(config, variant, f"{p}layers.{i}.", kind, rope_interleave)
    else:
        rules += _layer_rules(config, variant, layer, "dense", rope_interleave)
    rules.append((f"{p}norm.weight",) * 2)
    if class_name == "TinyCausalForCausalLM" and not config.tie_word_embeddings:
        rules.append(Rule(("lm_head.weight", *head_copies), "lm_head.weight"))
    if class_name == "TinyCausalForSequenceClassification":
        rules.append(("score.weight", "score.weight"))
    for k in mtp_layers:
        rules += _mtp_rules(config, variant, k, rope_interleave)
    return KeyMap(rules, ignore=IGNORED_BUFFERS)


def _layer_rules(config, variant: CausalVariant, layer: str, mlp_kind: str, rope_interleave: bool) -> list:
    """The rules of one decoder layer (layer: its prefix, a template with {i} or a concrete one): Llama's names on
    both sides, then the variant's."""
    qkv_bias = config.attention_bias
    out_bias = config.attention_bias if config.attention_output_bias is None else config.attention_output_bias
    rules: list = []
    if config.mla_spec() is not None:
        rules += deepseek.attention_rules(config, layer, rope_interleave=rope_interleave)
    else:
        for name in ATTENTION_PROJECTIONS:
            rules.append((f"{layer}self_attn.{name}.weight",) * 2)
            if qkv_bias:
                rules.append((f"{layer}self_attn.{name}.bias",) * 2)
        rules.append((f"{layer}self_attn.o_proj.weight",) * 2)
        if out_bias:
            rules.append((f"{layer}self_attn.o_proj.bias",) * 2)
    if mlp_kind != "sparse":
        for name in MLP_PROJECTIONS:
            rules.append((f"{layer}mlp.{name}.weight",) * 2)
            if config.mlp_bias:
                rules.append((f"{layer}mlp.{name}.bias",) * 2)
    for official_name, our_name in variant.layer_norms.items():
        rules.append((f"{layer}{official_name}.weight", f"{layer}{our_name}.weight"))
    if config.qk_norm and field_value(config, "qk_norm_type") != "l2":  # L2 q/k norms have no weights
        rules += [(f"{layer}self_attn.q_norm.weight",) * 2, (f"{layer}self_attn.k_norm.weight",) * 2]
    rules = variant.adapt_layer_rules(config, layer, rules)
    return rules + (variant.sparse_layer_rules(config, layer) if mlp_kind == "sparse" else [])


def _mtp_rules(config, variant: CausalVariant, k: int, rope_interleave: bool) -> list:
    """Multi-Token Prediction module k: stored by DeepSeek as decoder layer num_hidden_layers + k (its block's
    tensors, plus enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and head mapped above);
    ours is mtp.{k} (mtp.{k}.block the decoder block)."""
    official = f"model.layers.{config.num_hidden_layers + k}."
    ours = f"mtp.{k}."
    kind = "sparse" if config.moe_spec() is not None else "dense"
    rules = []
    for rule in _layer_rules(config, variant, official, kind, rope_interleave):
        rule = rule if isinstance(rule, Rule) else Rule(*rule)
        target = tuple(key.replace(official, f"{ours}block.", 1) for key in rule.target)
        rules.append(Rule(rule.source, target, rule.transform, rule.optional))
    rules += [(f"{official}{name}.weight", f"{ours}{name}.weight") for name in ("enorm", "hnorm", "eh_proj")]
    rules.append((f"{official}shared_head.norm.weight", f"{ours}norm.weight"))
    return rules


def layer_counts(config) -> int | dict[str, int]:
    """The key map's placeholder counts: layers ({i}), and experts ({e}) in a MoE model."""
    if config.moe_spec() is not None:
        return {"i": config.num_hidden_layers, "e": config.num_local_experts}
    return config.num_hidden_layers


# ----------------------------------------------------------------------------------------------------------------
# Classes
# ----------------------------------------------------------------------------------------------------------------


def _class_for_official(architectures, state: dict, *, src) -> str:
    named = (architectures or [None])[0]
    if named:
        for variant in OFFICIAL_TYPES.values():
            for ours, official in variant.official_classes.items():
                if named == official:
                    return ours
        raise ConversionError(
            f"{src}: architecture {named!r} is not supported; supported: "
            + ", ".join(official for variant in OFFICIAL_TYPES.values() for official in variant.official_classes.values())
        )
    if "score.weight" in state:
        return "TinyCausalForSequenceClassification"
    if "embed_tokens.weight" in state:
        return "TinyCausalModel"
    return "TinyCausalForCausalLM"


UNTIED_HINT = "; set tie_word_embeddings=false in config.json if the head is really untied"
OFFICIAL_NOTES = {
    "gguf": "`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` on the same file",
    "hf": "`from_pretrained` on the source folder",
    "meta": "`LlamaForCausalLM` holding the same weights in the Hugging Face layout (transformers has no loader for "
    "Meta's layout; the RoPE permutation itself is checked by the test suite)",
}


class LlamaFamily(CausalFamily):
    name = "llama"
    model_types = HF_MODEL_TYPES
    gguf_architectures = GGUF_ARCHITECTURES
    card_family = ("hf_tiny_causal (Llama-style decoder: Llama, Mistral, Qwen2, Qwen3, Gemma 3, Mixtral, Qwen2-MoE, "
                   "Qwen3-MoE, DeepSeek-V3, SmolLM3, OLMo 2, GPT-OSS, Llama 4 text)")
    tags = ("causal-lm", "text-generation")  # and the source's model type (Plan.tags)

    def read(self, src: Path) -> Source:
        kind, path = detect_source(src)
        if kind == "hf":
            source = super().read(path)
            source.description = f"the Hugging Face {source.raw_config['model_type']} folder `{source_name(path)}`"
            if source.raw_config.get("model_type") == gpt_oss.VARIANT.model_type:
                source.state, note = gpt_oss.dequantized_view(source.state, src=path)
                source.notes += [note] if note else []
            return source
        if kind == "gguf":
            return self.read_gguf(path)
        return read_meta_source(path)

    def plan(self, source: Source) -> Plan:
        """The official side is the source's own model type (config.json's), whatever fields it uses; a Meta
        checkpoint's is Llama."""
        if source.kind == "meta":
            config = meta_config(source.raw_config, source.state, src=source.path)
            class_name, mapping, state, notes = "TinyCausalForCausalLM", meta_key_map(config), source.state, []
            model_type = official_family(config)
        else:
            model_type = source.raw_config["model_type"]
            check_layer_types(source.raw_config, src=source.path)
            config = causal_config_from_official(official_config(source.raw_config, src=source.path), src=source.path)
            class_name = "TinyCausalForCausalLM" if source.kind == "gguf" else _class_for_official(
                source.raw_config.get("architectures"), source.state, src=source.path)
            config, state, notes = self._held_tensors(source, config, class_name)
            mapping = key_map(config, class_name, rope_interleave=source.raw_config.get("rope_interleave", True),
                              model_type=model_type)
        official_class = OFFICIAL_TYPES[model_type].official_class(class_name, src=source.path)
        note = f"The official side is {OFFICIAL_NOTES[source.kind]}."
        return Plan(config, class_name, official_class, mapping, layer_counts(config), state, notes=[note, *notes],
                    tags=(model_type,))

    @staticmethod
    def _held_tensors(source: Source, config, class_name: str):
        """(config, state, notes) for the tensors the checkpoint holds: a tied head's stored copy dropped, MTP
        modules kept only when all are stored."""
        state, notes = source.state, list(source.notes)
        if class_name == "TinyCausalForCausalLM" and config.tie_word_embeddings:
            state = drop_tied_copies(state, "model.embed_tokens.weight", ["lm_head.weight"], src=source.path,
                                     hint=UNTIED_HINT)
        if config.mtp_depth():
            config, mtp_note = deepseek.mtp_layers_held(config, state, class_name, src=source.path)
            notes.append(mtp_note)
        return config, state, notes

    def official_stream(self, source: Source, plan: Plan):
        if source.kind != "meta":
            return super().official_stream(source, plan)
        import transformers

        official_class = getattr(transformers, plan.official_class)
        tensors = plan.key_map.lazy_view(plan.state, num_layers=plan.num_layers)  # Llama's names are hf_tiny's
        return Streamed(official_class, official_config_from_causal(plan.config, plan.official_class), tensors)

    def official_model(self, source: Source, plan: Plan):
        if source.kind != "meta":
            return super().official_model(source, plan)
        return meta_official_model(plan, official_config_from_causal(plan.config, plan.official_class))

    def reverse(self, config, our_class: str, src: Path) -> ReversePlan:
        model_type = official_family(config)
        official_class = OFFICIAL_TYPES[model_type].official_class(our_class, src=src)
        mtp = range(config.num_hidden_layers, config.num_hidden_layers + config.mtp_depth())
        return ReversePlan(official_class, official_config_from_causal(config, official_class, model_type),
                           key_map(config, our_class, model_type=model_type), layer_counts(config),
                           stored_as_loaded=config.moe_spec() is None,
                           dropped_by_official=tuple(rf"model\.layers\.{index}\..*" for index in mtp))


FAMILY = LlamaFamily()
convert, convert_back = entry_points(FAMILY)

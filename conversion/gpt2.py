"""GPT-2 (transformers `model_type: gpt2`) <-> hf_tiny causal LM.

    python -m conversion [gpt2] SRC DST              official GPT-2 folder, gpt2 GGUF or nanoGPT ckpt.pt -> hf_tiny
                                                     folder
    python -m conversion [gpt2] SRC DST --reverse    hf_tiny causal folder (learned positions) -> GPT-2 folder

GPT-2 is the causal family's block with other parts chosen (TinyCausalConfig): learned absolute positions,
LayerNorm with biases, a plain (ungated) MLP with gelu_new, biases on every projection, a tied head. What
differs is only the layout of the weights, named here:
  * `Conv1D` layers store their weight as [in, out], the transpose of nn.Linear's [out, in];
  * `attn.c_attn` is q, k and v fused into one projection of width 3 x hidden (split / joined by a transform).
nanoGPT checkpoints (`ckpt.pt`: {"model": state dict, "model_args": {n_layer, n_head, n_embd, block_size, bias,
vocab_size, dropout}}) hold the same model with nn.Linear layers, exact GELU and optional biases: they are first
put into GPT-2's layout (`nanogpt_to_gpt2_layout`; bias=False becomes zero biases, which compute the same) and
then take the GPT-2 path; the official side is GPT2LMHeadModel holding those weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import ConversionError
from .keymap import KeyMap, Rule, Transform
from .lazy import LazyTensors
from .causal import (
    OUR_CLASSES, SingleTypeFamily, build_causal_config, embedding_rule, head_rules, label_fields, require_class,
)
from .pipeline import Plan, Source, entry_points
from .readers import official_config, torch_load_weights_only
from .writer import drop_tied_copies

# hf_tiny class -> (official class, prefix of the official base model's tensors)
OFFICIAL_CLASSES = {
    "TinyCausalForCausalLM": ("GPT2LMHeadModel", "transformer."),
    "TinyCausalForSequenceClassification": ("GPT2ForSequenceClassification", "transformer."),
    "TinyCausalModel": ("GPT2Model", ""),
}
# Per layer, official module -> ours; each with .weight and .bias.
LAYER_NORMS = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
# Conv1D layers ([in, out] weights) -> our nn.Linear ([out, in])
CONV1D_LAYERS = {"attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# Old checkpoints carry the causal-mask buffers; the model builds its own masks.
IGNORED_BUFFERS = (r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",)

CONV1D_TRANSPOSE = Transform("conv1d_transpose", lambda w: w.t().contiguous(), lambda w: w.t().contiguous())


def fused_qkv_weight(hidden: int) -> Transform:
    """c_attn.weight [hidden, 3 * hidden] (Conv1D) <-> q, k, v weights [hidden, hidden] each (nn.Linear)."""

    def split(weight: torch.Tensor):
        _check_fused_width(weight.shape[-1], hidden, "c_attn.weight", tuple(weight.shape))
        return tuple(part.contiguous() for part in weight.t().split(hidden, dim=0))

    def join(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat((q, k, v), dim=0).t().contiguous()

    return Transform(f"split_fused_qkv_conv1d({hidden})", split, join)


def fused_qkv_bias(hidden: int) -> Transform:
    def split(bias: torch.Tensor):
        _check_fused_width(bias.shape[-1], hidden, "c_attn.bias", tuple(bias.shape))
        return tuple(part.contiguous() for part in bias.split(hidden))

    return Transform(f"split_fused_qkv_bias({hidden})", split, lambda q, k, v: torch.cat((q, k, v)))


def _check_fused_width(width: int, hidden: int, name: str, shape: tuple) -> None:
    if width != 3 * hidden:
        raise ConversionError(
            f"{name} has shape {shape}: its fused q/k/v width {width} must be 3 x n_embd = {3 * hidden}"
        )


def key_map(config, class_name: str = "TinyCausalForCausalLM") -> KeyMap:
    require_class(class_name, OFFICIAL_CLASSES)
    official_prefix = OFFICIAL_CLASSES[class_name][1]
    ours = OUR_CLASSES[class_name][2]
    source, target = f"{official_prefix}h.{{i}}.", f"{ours}layers.{{i}}."
    hidden = config.hidden_size
    rules: list = [
        embedding_rule(config, class_name, f"{official_prefix}wte.weight"),
        (f"{official_prefix}wpe.weight", f"{ours}embed_positions.weight"),
        Rule(f"{source}attn.c_attn.weight", tuple(f"{target}{name}.weight" for name in QKV), fused_qkv_weight(hidden)),
        Rule(f"{source}attn.c_attn.bias", tuple(f"{target}{name}.bias" for name in QKV), fused_qkv_bias(hidden)),
    ]
    for official, our_name in CONV1D_LAYERS.items():
        rules.append(Rule(f"{source}{official}.weight", f"{target}{our_name}.weight", CONV1D_TRANSPOSE))
        rules.append((f"{source}{official}.bias", f"{target}{our_name}.bias"))
    for official, our_name in {**{f"{source}{k}": f"{target}{v}" for k, v in LAYER_NORMS.items()},
                               f"{official_prefix}ln_f": f"{ours}norm"}.items():
        rules += [(f"{official}.weight", f"{our_name}.weight"), (f"{official}.bias", f"{our_name}.bias")]
    return KeyMap(rules + head_rules(config, class_name), ignore=IGNORED_BUFFERS)


# ----------------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------------

# TinyCausalConfig fields every GPT-2 has (the reverse direction requires them)
GPT2_STRUCTURE = dict(
    position_embedding_type="learned", norm_type="layernorm", mlp_gated=False, attention_bias=True,
    attention_output_bias=None, mlp_bias=True, qk_norm=False, rms_norm_unit_offset=False, scale_embeddings=False,
    sandwich_norms=False, final_logit_softcapping=None,
)


def causal_config_from_gpt2(official, *, src):
    if official.scale_attn_by_inverse_layer_idx:
        raise ConversionError(
            f"{src}: scale_attn_by_inverse_layer_idx=True (attention scaled by 1 / (layer + 1)) is not supported"
        )
    if getattr(official, "add_cross_attention", False):
        raise ConversionError(f"{src}: add_cross_attention=True (GPT-2 as a seq2seq decoder) is not supported")
    values = dict(
        GPT2_STRUCTURE,
        vocab_size=official.vocab_size,
        hidden_size=official.n_embd,
        intermediate_size=official.n_inner or 4 * official.n_embd,
        num_hidden_layers=official.n_layer,
        num_attention_heads=official.n_head,
        hidden_act=official.activation_function,
        max_position_embeddings=official.n_positions,
        initializer_range=official.initializer_range,
        layer_norm_eps=official.layer_norm_epsilon,
        attention_dropout=official.attn_pdrop,
        hidden_dropout=official.resid_pdrop,
        embedding_dropout=official.embd_pdrop,
        # scale_attn_weights=False: raw q.k scores (scale 1 = query_pre_attn_scalar 1)
        query_pre_attn_scalar=None if official.scale_attn_weights else 1.0,
        tie_word_embeddings=official.tie_word_embeddings,
        pad_token_id=official.pad_token_id,
        use_padding_idx=False,  # official GPT-2 / MPT embeddings have no padding row
        bos_token_id=official.bos_token_id,
        eos_token_id=official.eos_token_id,
    )
    return build_causal_config(values, official, src=src)


def gpt2_config_from_causal(config, official_class: str):
    import transformers

    differing = {k: getattr(config, k) for k, v in GPT2_STRUCTURE.items() if getattr(config, k) != v}
    if config.query_pre_attn_scalar not in (None, 1.0):
        differing["query_pre_attn_scalar"] = config.query_pre_attn_scalar
    if config.num_key_value_heads != config.num_attention_heads or config.head_dim * config.num_attention_heads != config.hidden_size:
        differing["num_key_value_heads / head_dim"] = (config.num_key_value_heads, config.head_dim)
    if "sliding_attention" in config.layer_types:
        differing["layer_types"] = config.layer_types
    if differing:
        raise ConversionError(f"GPT-2 cannot hold this hf_tiny config: it differs from GPT-2's structure in {differing}")
    values = dict(
        vocab_size=config.vocab_size, n_embd=config.hidden_size, n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads, activation_function=config.hidden_act,
        n_inner=None if config.intermediate_size == 4 * config.hidden_size else config.intermediate_size,  # as gpt2's
        n_positions=config.max_position_embeddings, initializer_range=config.initializer_range,
        layer_norm_epsilon=config.layer_norm_eps, attn_pdrop=config.attention_dropout,
        resid_pdrop=config.hidden_dropout, embd_pdrop=config.embedding_dropout,
        scale_attn_weights=config.query_pre_attn_scalar is None, tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        architectures=[official_class], **label_fields(config),
    )
    return transformers.GPT2Config(**values)


BASE_MODEL_MODULES = ("h", "wte", "wpe", "ln_f")  # GPT2Model's; a head's own (lm_head, score) sit beside it


def with_base_prefix(source: Source) -> Source:
    """A folder of a GPT-2 head class (named, or the default) whose tensors lack the base model's `transformer.`
    prefix, as openai-community/gpt2 and distilgpt2 store theirs (h.0..., wte, wpe, ln_f): read under the head
    class's names, as official from_pretrained reads them (its base_model_prefix)."""
    architectures = list(source.raw_config.get("architectures") or ())
    if (architectures[:1] == ["GPT2Model"] or "h.0.attn.c_attn.weight" not in source.state
            or any(key.startswith("transformer.") for key in source.state)):
        return source
    source.state = LazyTensors.of(source.state).renamed(
        lambda key: f"transformer.{key}" if key.split(".")[0] in BASE_MODEL_MODULES else key)
    source.notes.append("Its tensors are stored without the `transformer.` prefix (as openai-community/gpt2 stores "
                        "them); read as the head class's, as official `from_pretrained` reads them.")
    return source


# nanoGPT
NANOGPT_FILE = "ckpt.pt"
NANOGPT_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
COMPILED_PREFIX = "_orig_mod."  # torch.compile'd modules save their parameters under it


def nanogpt_checkpoint(src: Path) -> Path | None:
    """The nanoGPT checkpoint file of SRC (a .pt file, or a folder holding ckpt.pt, without a config.json beside
    it: a Hugging Face folder's .pt/.bin weights are not nanoGPT's), else None."""
    folder = src.parent if src.is_file() else src
    if (folder / "config.json").exists():
        return None
    if src.is_file() and src.suffix in (".pt", ".pth"):
        return src
    if src.is_dir() and (src / NANOGPT_FILE).is_file():
        return src / NANOGPT_FILE
    return None


def read_nanogpt(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(GPT-2 config dict, state dict in GPT-2's layout) of a nanoGPT checkpoint."""
    checkpoint = torch_load_weights_only(path)
    if not isinstance(checkpoint, dict) or "model" not in checkpoint or "model_args" not in checkpoint:
        found = sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ConversionError(f"{path} is not a nanoGPT checkpoint: expected the keys 'model' and 'model_args', found {found}")
    args = checkpoint["model_args"]
    missing = [name for name in NANOGPT_ARGS if name not in args]
    if missing:
        raise ConversionError(f"{path}: model_args lacks {missing}; it has {sorted(args)}")
    state = {key.removeprefix(COMPILED_PREFIX): value for key, value in checkpoint["model"].items()}
    dropout = float(args.get("dropout", 0.0))
    config = dict(
        model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=args["vocab_size"], n_embd=args["n_embd"],
        n_layer=args["n_layer"], n_head=args["n_head"], n_positions=args["block_size"], activation_function="gelu",
        layer_norm_epsilon=1e-5, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, tie_word_embeddings=True,
        bos_token_id=50256 if args["vocab_size"] > 50256 else None, eos_token_id=50256 if args["vocab_size"] > 50256 else None,
    )
    return config, nanogpt_to_gpt2_layout(state, args["n_layer"], bool(args.get("bias", True)), src=path)


def nanogpt_to_gpt2_layout(state: dict, num_layers: int, bias: bool, *, src) -> dict:
    """nanoGPT's nn.Linear weights [out, in] -> GPT-2's Conv1D [in, out]; without biases (bias=False), zero biases
    (the same function); the tied lm_head copy dropped."""
    state = drop_tied_copies(state, "transformer.wte.weight", ["lm_head.weight"], src=src)
    out = dict(state)
    for i in range(num_layers):
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            key = f"transformer.h.{i}.{name}.weight"
            if key not in state:
                raise ConversionError(f"{src}: the nanoGPT state dict lacks {key}")
            out[key] = state[key].t().contiguous()
            if not bias:
                out.setdefault(f"transformer.h.{i}.{name}.bias", torch.zeros(state[key].shape[0], dtype=state[key].dtype))
        if not bias:
            for norm in ("ln_1", "ln_2"):
                weight = state[f"transformer.h.{i}.{norm}.weight"]
                out.setdefault(f"transformer.h.{i}.{norm}.bias", torch.zeros_like(weight))
    if not bias:
        out.setdefault("transformer.ln_f.bias", torch.zeros_like(state["transformer.ln_f.weight"]))
    return out


class Gpt2Family(SingleTypeFamily):
    official_classes = {ours: official for ours, (official, _prefix) in OFFICIAL_CLASSES.items()}
    word_embeddings = "transformer.wte.weight"
    config_from_official = staticmethod(causal_config_from_gpt2)
    official_config_of = staticmethod(gpt2_config_from_causal)
    key_map = staticmethod(key_map)
    # official's eager attention computes its scores in float32 with it; hf_tiny's always does
    kept_fields = ("reorder_and_upcast_attn",)

    def read(self, src: Path) -> Source:
        nanogpt = nanogpt_checkpoint(src)
        if nanogpt is not None:
            raw, state = read_nanogpt(nanogpt)
            return Source(nanogpt, nanogpt.parent, "nanogpt", raw, state, f"the nanoGPT checkpoint `{nanogpt.name}`")
        return with_base_prefix(super().read(src, allow_missing_model_type=True))

    def plan_notes(self, source: Source, official) -> list[str]:
        if source.kind != "nanogpt":
            return []
        return ["The official side is `GPT2LMHeadModel` (exact GELU) holding the nanoGPT weights in GPT-2's layout "
                "(Linear weights transposed to Conv1D; a bias=False model gets zero biases)."]

    def official_model(self, source: Source, plan: Plan):
        if source.kind == "nanogpt":
            import transformers

            model = transformers.GPT2LMHeadModel(official_config(source.raw_config, src=source.path))
            model.load_state_dict({k: v.float() for k, v in source.state.items()}, strict=False)
            missing = set(model.state_dict()) - set(source.state) - {"lm_head.weight"}
            missing = {k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))}
            if missing:
                raise ConversionError(f"{source.path}: GPT2LMHeadModel found no weights for {sorted(missing)}")
            return model.eval()
        return super().official_model(source, plan)

    def write_side_files(self, source: Source, plan: Plan, tmp: Path) -> str:
        if source.kind == "nanogpt":
            return "none (nanoGPT checkpoints carry no tokenizer; GPT-2's BPE is the usual one)"
        return super().write_side_files(source, plan, tmp)


FAMILY = Gpt2Family(
    "gpt2", "a GPT-2", "hf_tiny_causal (decoder block with GPT-2's parts: learned positions, LayerNorm, GELU MLP)",
    gguf=True, markers=("transformer.h.0.attn.c_attn.weight", "h.0.attn.c_attn.weight"))
convert, convert_back = entry_points(FAMILY)

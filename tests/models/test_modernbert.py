"""ModernBERT: the hf_tiny encoder with ModernBERT's parts (rotary positions with a global and a local theta,
pre-norm layers, local sliding-window attention, GeGLU, no biases, the prediction head before every task head),
converted both ways by conversion/modernbert.py.

Official models are built with odd shapes (hidden 48, 3 heads, 5 layers: global, local, local, global, local) and
large random weights, saved, converted with the production converter and compared with the official class on
padded batches longer than the local window; the reference values come from official transformers only.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from transformers import ModernBertConfig

import hf_tiny
from conversion import ConversionError
from conversion import modernbert
from conversion.registry import detect_family
from hf_tiny import TinyEncoderConfig, runtime
from hf_tiny.masks import encoder_masks
from runtime_checks import ops_of
from tolerances import relative_error

VOCAB = 97
PAD = 0
CLASSES = ["ModernBertModel", "ModernBertForMaskedLM", "ModernBertForSequenceClassification",
           "ModernBertForTokenClassification", "ModernBertForQuestionAnswering"]
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
PARITY = 1e-5  # fp32, relative to the official output's largest value
# local_attention 6: a local query sees 3 keys on each side, so 7 of the 12 positions
SHAPES = dict(vocab_size=VOCAB, hidden_size=48, num_attention_heads=3, num_hidden_layers=5, intermediate_size=40,
              global_attn_every_n_layers=3, local_attention=6, max_position_embeddings=64, pad_token_id=PAD,
              bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, initializer_range=0.25)
# Every optional part ModernBERT's config can turn on, on another window (odd: 7 // 2 = 3 keys each side)
WITH_BIASES = dict(attention_bias=True, mlp_bias=True, norm_bias=True, classifier_bias=True, classifier_pooling="mean",
                   decoder_bias=False, tie_word_embeddings=False, local_attention=7, classifier_activation="silu")


def official_model(architecture: str, seed: int = 0, **fields):
    fields = {"num_labels": 2 if architecture.endswith("QuestionAnswering") else 3, **SHAPES, **fields}
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(ModernBertConfig(**fields))
    with torch.no_grad():  # norms and biases off their init, so that a mis-mapped one changes the outputs
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
    model.set_attn_implementation("eager")  # the reference: the plain math
    return model.eval()


def padded_batch(lengths=(12, 8, 3), seed: int = 1, left: bool = False) -> dict:
    """Rows of the given real lengths, padded with PAD to the longest (right-padded, as tokenizers do)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (len(lengths), max(lengths)), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
    if left:
        attention_mask = attention_mask.flip(-1)
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, PAD), "attention_mask": attention_mask}


def labelled(architecture: str, batch: dict) -> dict:
    """The batch with the labels the class's loss reads."""
    ids, real = batch["input_ids"], batch["attention_mask"].bool()
    if architecture.endswith("MaskedLM"):
        return {**batch, "labels": ids.masked_fill(~real, -100)}
    if architecture.endswith("SequenceClassification"):
        return {**batch, "labels": torch.tensor([0, 2, 1])}
    if architecture.endswith("TokenClassification"):
        return {**batch, "labels": (ids % 3).masked_fill(~real, -100)}
    if architecture.endswith("QuestionAnswering"):
        return {**batch, "start_positions": torch.tensor([1, 4, 0]), "end_positions": torch.tensor([5, 7, 2])}
    return batch


def outputs(model, batch: dict) -> dict[str, torch.Tensor]:
    """Every compared output (and the loss), per-token ones at the real tokens only."""
    with torch.no_grad():
        result = model(**batch)
    real = batch["attention_mask"].bool()
    found = {}
    for name in ("loss", "last_hidden_state", "logits", "start_logits", "end_logits"):
        value = getattr(result, name, None)
        if value is not None:
            found[name] = value[real] if value.dim() >= 2 and value.shape[:2] == real.shape else value
    return found


def official_loss(official, batch: dict) -> torch.Tensor:
    """The official loss in sdpa. QA's loss reads the logits of padding tokens too, and a padding query farther than
    the window from every real token sees no key: official eager then attends uniformly to all keys (the mask's
    finfo.min added to every score), official sdpa and every hf_tiny backend output zeros there."""
    official.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return official(**batch).loss
    finally:
        official.set_attn_implementation("eager")


def worst_error(official, ours, batch: dict) -> float:
    expected, got = outputs(official, batch), outputs(ours, batch)
    if "loss" in expected:
        expected["loss"] = official_loss(official, batch)
    assert expected and expected.keys() == got.keys(), (expected.keys(), got.keys())
    return max(relative_error(got[name], expected[name]) for name in expected)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{(architecture, variant): (official model, hf_tiny folder)}, converted on first use."""
    cache = {}

    def get(architecture: str, variant: str = "default"):
        if (architecture, variant) not in cache:
            official = official_model(architecture, **(WITH_BIASES if variant == "biases" else {}))
            folder = tmp_path_factory.mktemp(f"{architecture}-{variant}")
            official.save_pretrained(folder / "src")
            report = modernbert.convert(folder / "src", folder / "ours")
            assert report["architecture"] == architecture
            cache[architecture, variant] = official, folder
        return cache[architecture, variant]

    return get


def ours_from(folder, backend: str):
    config = json.loads((folder / "ours" / "config.json").read_text())
    return getattr(hf_tiny, config["architectures"][0]).from_pretrained(folder / "ours", attn_implementation=backend).eval()


# ---- parity ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", CLASSES)
def test_every_head_matches_official_in_eager_and_sdpa_with_windows_shorter_than_the_batch(architecture, converted):
    official, folder = converted(architecture)
    batch = labelled(architecture, padded_batch())
    for backend in ("eager", "sdpa"):
        ours = ours_from(folder, backend)
        assert worst_error(official, ours, batch) <= PARITY, backend
    if architecture != "ModernBertForSequenceClassification":  # its "cls" pooling would read a padding token
        assert worst_error(official, ours, labelled(architecture, padded_batch(left=True, seed=2))) <= PARITY


@pytest.mark.parametrize("architecture", ["ModernBertForMaskedLM", "ModernBertForSequenceClassification"])
def test_biases_mean_pooling_odd_window_and_untied_decoder_match_official(architecture, converted):
    official, folder = converted(architecture, "biases")
    batch = labelled(architecture, padded_batch())
    assert worst_error(official, ours_from(folder, "sdpa"), batch) <= PARITY


def test_hidden_states_match_official_at_every_layer(converted):
    official, folder = converted("ModernBertModel")
    ours, batch = ours_from(folder, "eager"), padded_batch()
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = official(**batch, output_hidden_states=True).hidden_states
        got = ours(**batch, output_hidden_states=True).hidden_states
    assert len(got) == len(expected) == 6  # the embeddings, four layers, the fifth layer's normed output
    assert max(relative_error(b[real], a[real]) for a, b in zip(expected, got)) <= PARITY


def test_flash_matches_official_within_the_window_and_refuses_a_window_it_cannot_apply(converted):
    """flash_attention_2 on CPU runs PyTorch's flash kernel one sequence at a time: it takes padding and causal
    masks only. Rows of at most 4 tokens lie within a local query's reach (3 keys on each side), so every layer
    runs there; a longer batch needs the bidirectional window, which it refuses with a clear error instead of
    attending past it."""
    official, folder = converted("ModernBertForMaskedLM")
    ours = ours_from(folder, "flash_attention_2")
    assert worst_error(official, ours, padded_batch((4, 3, 1))) <= PARITY
    with pytest.raises(ValueError, match="flash_attention_2.*sliding window.*sdpa"):
        ours(**padded_batch())


def test_negative_controls_each_new_mechanism_is_checked(converted):
    """A local layer rotated with the global theta, a window one key wider, and the GeGLU's halves swapped must
    each fail the same parity check."""
    official, folder = converted("ModernBertForMaskedLM")
    batch = padded_batch()
    global_theta = ours_from(folder, "sdpa")
    global_theta.model.sliding_rotary_emb = None
    wider = ours_from(folder, "sdpa")
    wider.config.sliding_window += 1
    swapped = ours_from(folder, "sdpa")
    mlp = swapped.model.layers[2].mlp
    with torch.no_grad():
        gate = mlp.gate_proj.weight.clone()
        mlp.gate_proj.weight.copy_(mlp.up_proj.weight)
        mlp.up_proj.weight.copy_(gate)
    for ours in (global_theta, wider, swapped):
        assert worst_error(official, ours, batch) > 1e-3


# ---- conversion ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", CLASSES)
def test_round_trip_reloads_the_official_class_bit_for_bit(architecture, converted, tmp_path):
    official, folder = converted(architecture)
    report = modernbert.convert_back(folder / "ours", tmp_path / "back")
    assert report["architecture"] == architecture
    reloaded, info = getattr(transformers, architecture).from_pretrained(
        tmp_path / "back", output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = reloaded.state_dict()
    assert state.keys() == official.state_dict().keys()
    assert all(torch.equal(tensor, state[name]) for name, tensor in official.state_dict().items())
    batch = labelled(architecture, padded_batch())
    expected, got = outputs(official, batch), outputs(reloaded.eval(), batch)  # both official, both eager
    assert expected.keys() == got.keys() and all(torch.equal(got[name], expected[name]) for name in expected)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back["layer_types"], back["local_attention"], back["rope_parameters"]) == (
        LAYER_TYPES, 6, official.config.rope_parameters)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_outputs_equal_official_bit_for_bit_with_its_rotation_rounding(converted, dtype):
    """Official rounds cos / sin to the model's dtype and rotates q / k in float32 (sdpa on both sides: hf_tiny's eager
    scores are float32, docs/architecture.md). Negative control: rotated in the model's dtype (Llama's rounding), bf16
    logits were 0.109 off official's."""
    official, folder = converted("ModernBertForMaskedLM")
    official = transformers.ModernBertForMaskedLM.from_pretrained(folder / "src", dtype=dtype).eval()
    official.set_attn_implementation("sdpa")
    ours = hf_tiny.TinyEncoderForMaskedLM.from_pretrained(folder / "ours", dtype=dtype).eval()
    batch = padded_batch()
    with torch.no_grad():
        expected = official(**batch).logits
        assert torch.equal(ours(**batch).logits, expected)
        rotaries = [module for module in ours.modules() if isinstance(module, hf_tiny.layers.RotaryEmbedding)]
        for module in rotaries:
            module.rounded_float32 = False
        assert rotaries and not torch.equal(ours(**batch).logits, expected)


def test_deterministic_flash_attn_is_kept_for_the_way_back(tmp_path):
    """A hint to official's flash-attn backward that hf_tiny's models do not read: kept in the hf_tiny config as it
    is, and written back; official's default, False, where an hf_tiny config lacks it (converted before, or made
    from scratch)."""
    for value, name in ((True, "set"), (None, "absent")):
        official_model("ModernBertForMaskedLM", deterministic_flash_attn=True).save_pretrained(tmp_path / name / "src")
        modernbert.convert(tmp_path / name / "src", tmp_path / name / "ours")
        config_file = tmp_path / name / "ours" / "config.json"
        ours = json.loads(config_file.read_text())
        assert ours.pop("deterministic_flash_attn") is True
        if value is not None:
            ours["deterministic_flash_attn"] = value
        config_file.write_text(json.dumps(ours))
        modernbert.convert_back(tmp_path / name / "ours", tmp_path / name / "back")
        back = transformers.AutoConfig.from_pretrained(tmp_path / name / "back")
        assert back.deterministic_flash_attn is bool(value), name


def test_the_family_is_detected_both_ways(converted):
    _, folder = converted("ModernBertForMaskedLM")
    assert detect_family(folder / "src")[0] == "modernbert"
    name, why = detect_family(folder / "ours", reverse=True)
    assert name == "modernbert" and "norm_placement='pre'" in why


@pytest.mark.parametrize("field, value", [("sparse_prediction", True), ("attention_dropout", 0.1)])
def test_options_without_an_hf_tiny_equivalent_are_refused_by_name(field, value, tmp_path):
    official_model("ModernBertForMaskedLM", **{field: value}).save_pretrained(tmp_path / "src")
    with pytest.raises(ConversionError, match=f"{field}={value}"):
        modernbert.convert(tmp_path / "src", tmp_path / "ours")


def test_reverse_refuses_residual_dropout_modernbert_has_no_place_for(converted, tmp_path):
    _, folder = converted("ModernBertForMaskedLM")
    shutil.copytree(folder / "ours", tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    (tmp_path / "ours" / "config.json").write_text(json.dumps({**config, "hidden_dropout": 0.1}))
    with pytest.raises(ConversionError, match="hidden_dropout=0.1"):
        modernbert.convert_back(tmp_path / "ours", tmp_path / "back")


HEADS_FROM_THE_MASKED_LM = {"ModernBertForSequenceClassification": "TinyEncoderForSequenceClassification",
                             "ModernBertForTokenClassification": "TinyEncoderForTokenClassification",
                             "ModernBertForQuestionAnswering": "TinyEncoderForQuestionAnswering"}


def classifier_from_masked_lm(folder, our_class: str, official):
    """An hf_tiny classifier loaded from a converted masked-LM folder, its new classifier copied from `official`
    (the same class loaded from the official masked-LM folder), and the load report."""
    ours, info = getattr(hf_tiny, our_class).from_pretrained(
        folder, num_labels=official.config.num_labels, attn_implementation="eager", output_loading_info=True)
    ours_new = ours.qa_outputs if our_class.endswith("QuestionAnswering") else ours.classifier
    ours_new.load_state_dict(official.classifier.state_dict())
    return ours.eval(), info


def pre_shared_head_layout(folder, destination):
    """A copy of a converted ModernBERT masked-LM folder as converters wrote it before shared_head: the transform
    under lm_head.dense / lm_head.layer_norm, no shared_head in config.json."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, destination)
    config = json.loads((destination / "config.json").read_text())
    assert config.pop("shared_head") is True
    (destination / "config.json").write_text(json.dumps(config))
    state = load_file(destination / "model.safetensors")
    save_file({("lm_head." + k[len("head."):]) if k.startswith("head.") else k: v for k, v in state.items()},
              destination / "model.safetensors", metadata={"format": "pt"})
    return destination


@pytest.mark.parametrize("official_class, our_class", HEADS_FROM_THE_MASKED_LM.items())
def test_a_classifier_loaded_from_a_masked_lm_folder_starts_from_its_trained_head_as_official(
        official_class, our_class, converted, tmp_path):
    """Fine-tuning starts from a masked-LM checkpoint: official's classifiers reuse its trained `head` (dense, act,
    norm) and only the classifier is new. Negative control: a folder converted before shared_head still loads as a
    masked LM, but its classifiers start the transform from the init, and their logits differ."""
    official_mlm, folder = converted("ModernBertForMaskedLM")
    labels = 2 if official_class.endswith("QuestionAnswering") else 3
    torch.manual_seed(3)
    official = getattr(transformers, official_class).from_pretrained(
        folder / "src", num_labels=labels, attn_implementation="eager").eval()
    ours, info = classifier_from_masked_lm(folder / "ours", our_class, official)
    assert {key.split(".")[0] for key in info["missing_keys"]} == {"qa_outputs" if labels == 2 else "classifier"}
    batch = padded_batch()
    assert worst_error(official, ours, batch) <= PARITY
    older = pre_shared_head_layout(folder / "ours", tmp_path / "older")
    older_mlm = hf_tiny.TinyEncoderForMaskedLM.from_pretrained(older, attn_implementation="eager").eval()
    assert worst_error(official_mlm, older_mlm, labelled("ModernBertForMaskedLM", batch)) <= PARITY
    fresh, info = classifier_from_masked_lm(older, our_class, official)
    assert [key for key in info["missing_keys"] if key.endswith("dense.weight")]  # the pooler's or the head's
    assert worst_error(official, fresh, batch) > 1e-3


def test_a_folder_converted_before_shared_head_converts_back_bit_for_bit(converted, tmp_path):
    official, folder = converted("ModernBertForMaskedLM")
    older = pre_shared_head_layout(folder / "ours", tmp_path / "older")
    assert detect_family(older, reverse=True)[0] == "modernbert"  # not BERT: shared_head only names tensors
    modernbert.convert_back(older, tmp_path / "back")
    reloaded = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "back")
    state = reloaded.state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in official.state_dict().items())


# ---- the model on its own --------------------------------------------------------------------------------------------


def modernbert_config(**fields) -> TinyEncoderConfig:
    """An hf_tiny encoder with ModernBERT's parts, built directly."""
    return TinyEncoderConfig(**{
        "vocab_size": VOCAB, "hidden_size": 48, "num_attention_heads": 3, "num_hidden_layers": 5,
        "intermediate_size": 40, "max_position_embeddings": 64, "type_vocab_size": 0, "position_embedding_type": "rope",
        "rope_parameters": {"full_attention": {"rope_theta": 160000.0}, "sliding_attention": {"rope_theta": 10000.0}},
        "layer_types": LAYER_TYPES, "sliding_window": 3, "norm_placement": "pre", "norm_bias": False,
        "mlp_gated": True, "mlp_bias": False, "attention_bias": False, "head_transform": True, "classifier_bias": False,
        "initializer_range": 0.3, **fields,
    })


def test_sliding_masks_see_the_keys_within_reach_on_both_sides_and_never_padding():
    batch = padded_batch((12, 8, 3))
    masks = encoder_masks(modernbert_config(), batch["attention_mask"], batch_size=3, length=12, device="cpu")
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    real_key = batch["attention_mask"].bool()[:, None, None, :]
    assert torch.equal(masks["sliding_attention"].mask, ((i - j).abs() <= 3) & real_key)
    assert torch.equal(masks["full_attention"].mask, real_key.expand(3, 1, 12, 12))
    unpadded = encoder_masks(modernbert_config(), None, batch_size=1, length=4, device="cpu")
    assert unpadded["sliding_attention"].mask is None  # 4 positions all lie within reach: nothing to mask


def test_runtime_on_and_off_are_bit_identical(monkeypatch):
    monkeypatch.setattr(runtime, "MIN_ELEMENTS", 1)  # the tiny model runs in place as a large batch would
    torch.manual_seed(0)
    config = modernbert_config(hidden_dropout=0.1, embedding_dropout=0.1, activation_dropout=0.1, attention_dropout=0.1)
    model = hf_tiny.TinyEncoderForMaskedLM(config).eval()
    batch = labelled("ModernBertForMaskedLM", padded_batch())

    def run():
        with torch.inference_mode():
            ops = ops_of(lambda: model(**batch))
            logits = model(**batch).logits
        model.train()
        torch.manual_seed(5)  # the same dropout masks in both runs
        loss = model(**batch).loss
        grads = torch.autograd.grad(loss, list(model.parameters()))
        model.eval()
        return ops, [logits, loss, *grads]

    assert runtime.is_enabled(model)
    on_ops, on = run()
    with runtime.disabled():
        off_ops, off = run()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
    assert "add_" in on_ops and "add_" not in off_ops  # the pre-norm layers ran in place: the runtime acted
    model.set_runtime(False)
    assert not runtime.is_enabled(model)


def test_config_holds_modernbert_fields_only_when_used_and_names_bad_values():
    bert = TinyEncoderConfig().to_dict()
    assert not {"position_embedding_type", "layer_types", "norm_placement", "mlp_gated", "rope_parameters"} & set(bert)
    config = modernbert_config()
    assert config.to_dict()["norm_placement"] == "pre" and "classifier_pooling" not in config.to_dict()
    again = TinyEncoderConfig.from_dict(config.to_dict())
    assert again.rope_parameters_for("sliding_attention")["rope_theta"] == 10000.0
    assert again.attention_types() == LAYER_TYPES
    for fields, message in (
        (dict(norm_placement="middle"), "norm_placement 'middle'"),
        (dict(position_embedding_type="absolute"), "rope_parameters=.*position_embedding_type='rope'"),
        (dict(sliding_window=None), "sliding_window is None"),
        (dict(classifier_pooling="max"), "classifier_pooling 'max'"),
        (dict(shared_head=True, head_transform=False), "shared_head=True .*head_transform=False"),
        (dict(shared_head=True, embedding_size=24), "shared_head=True .*embedding_size=24"),
        (dict(shared_head=True, dropout_before_pooler=True), "dropout_before_pooler=True"),
        (dict(shared_head=True, pre_classifier=True), "shared_head=True .*pre_classifier=True"),
    ):
        with pytest.raises(ValueError, match=message):
            modernbert_config(**fields)
    for name in ("shared_head", "pre_classifier"):
        with pytest.raises(TypeError, match=f"{name} must be True or False, got 'yes'"):
            modernbert_config(**{name: "yes"})

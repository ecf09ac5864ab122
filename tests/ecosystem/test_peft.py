"""PEFT LoRA on every hf_tiny family with the documented target_modules: training changes only the adapter
weights, merge_and_unload computes what the adapter model computes, adapters save and load (through PEFT and
through transformers' own load_adapter), and target_modules that match nothing is a clear error."""

from __future__ import annotations

import copy
import functools
import json
import tempfile
import zlib

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, PromptTuningConfig, get_peft_model

import hf_tiny

# The documented LoRA targets (docs/compatibility.md, "PEFT / LoRA"): attention projections of every attention
# module (self- and cross-attention) and the feed-forward projections; gate_proj exists only in gated MLPs.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYERS = 2

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _encoder():
    config = hf_tiny.TinyEncoderConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=32, initializer_range=0.2, hidden_dropout=0.0, attention_dropout=0.0, num_labels=3,
    )
    return hf_tiny.TinyEncoderForSequenceClassification(config), "SEQ_CLS"


def _causal():
    config = hf_tiny.TinyCausalConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, initializer_range=0.2, pad_token_id=0,
    )
    return hf_tiny.TinyCausalForCausalLM(config), "CAUSAL_LM"


def _seq2seq():
    config = hf_tiny.TinySeq2SeqConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
        max_position_embeddings=32, initializer_range=0.2, hidden_dropout=0.0, attention_dropout=0.0,
    )
    return hf_tiny.TinySeq2SeqForConditionalGeneration(config), "SEQ_2_SEQ_LM"


FAMILIES = {"encoder": _encoder, "causal": _causal, "seq2seq": _seq2seq}
# LoRA-wrapped Linear layers per family: (attention modules per layer x 4 projections) + MLP projections.
EXPECTED_WRAPPED = {
    "encoder": LAYERS * (4 + 2),  # self-attention; up/down
    "causal": LAYERS * (4 + 3),  # self-attention; gate/up/down
    "seq2seq": LAYERS * (4 + 2) + LAYERS * (4 + 4 + 2),  # encoder; decoder self + cross attention; up/down
}


def _batch(family: str) -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (4, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[3, 4:] = 0
    if family == "encoder":
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2, 1, 2])}
    if family == "causal":
        left = mask.flip(-1)  # causal LMs pad on the left
        return {"input_ids": ids, "attention_mask": left, "labels": ids.masked_fill(left == 0, -100)}
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(3, 97, (4, 5), generator=generator)}


def _logits(model, batch: dict) -> torch.Tensor:
    """Logits of a batch; encoder-decoders get their decoder inputs from the labels (shifted right)."""
    inputs = dict(batch)
    if not model.config.is_encoder_decoder:
        inputs.pop("labels")
    with torch.no_grad():
        return model(**inputs).logits


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def trained(request, tmp_path_factory):
    """(family, trained PEFT model, base folder, adapter folder, batch, base logits, losses, base state before)."""
    family = request.param
    torch.manual_seed(0)
    model, task_type = FAMILIES[family]()
    root = tmp_path_factory.mktemp(f"peft_{family}")
    model.save_pretrained(root / "base")
    batch = _batch(family)
    base_logits = _logits(model.eval(), batch)
    base_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type=task_type)
    peft_model = get_peft_model(model, config)
    adapter_init = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for _ in range(6):
        loss = peft_model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    peft_model.eval()
    peft_model.save_pretrained(root / "adapter")
    return family, peft_model, root, batch, base_logits, losses, (base_state, adapter_init)


def test_lora_wraps_exactly_the_documented_projections(trained):
    family, peft_model, *_ = trained
    wrapped = [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")]
    assert len(wrapped) == EXPECTED_WRAPPED[family], wrapped
    assert {name.rsplit(".", 1)[-1] for name in wrapped} <= set(LORA_TARGETS)
    if family == "seq2seq":
        assert any(".cross_attn." in name for name in wrapped)


def test_training_changes_only_adapter_weights(trained):
    _, peft_model, _, _, _, losses, (base_state, adapter_init) = trained
    assert losses[-1] < losses[0], losses
    trained_now = dict(peft_model.named_parameters())
    assert any("lora_A" in name for name in adapter_init) and any("lora_B" in name for name in adapter_init)
    for name, initial in adapter_init.items():  # every adapter tensor (and modules_to_save head) has moved
        assert not torch.equal(trained_now[name], initial), f"{name} never trained"
    base = peft_model.get_base_model()
    # every weight of the original model is bit-for-bit what it was
    for name, tensor in base.state_dict().items():
        if "lora_" in name or ".modules_to_save." in name:
            continue
        original = name.replace(".base_layer.", ".").replace(".original_module.", ".")
        assert torch.equal(tensor, base_state[original]), f"{name} changed during LoRA training"
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert all("lora_" in name or ".modules_to_save." in name for name in trainable), trainable


def test_merge_and_unload_matches_adapter_model(trained):
    family, peft_model, root, batch, base_logits, _, _ = trained
    adapter_logits = _logits(peft_model, batch)
    # negative control: the trained adapter changes the outputs well beyond the tolerance used below
    assert (adapter_logits - base_logits).abs().max() > 1e-2
    base = type(peft_model.get_base_model()).from_pretrained(root / "base")
    merged = PeftModel.from_pretrained(base, root / "adapter").merge_and_unload().eval()
    assert type(merged).__module__.startswith("hf_tiny.")
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    merged_logits = _logits(merged, batch)
    scale = max(1.0, adapter_logits.abs().max().item())
    diff = (merged_logits - adapter_logits).abs().max().item()
    assert diff <= 1e-5 * scale, f"{family}: merged logits differ by {diff} (scale {scale:.3g})"


@functools.lru_cache(maxsize=None)
def load_adapter_restores_task_heads() -> bool:
    """Whether this transformers' PreTrainedModel.load_adapter loads a SEQ_CLS adapter's trained classifier (5.24
    does, 5.16.1 does not), probed on official BERT."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=17, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=8, num_labels=2)
    with tempfile.TemporaryDirectory() as folder:
        base = transformers.BertForSequenceClassification(config).eval()
        base.save_pretrained(f"{folder}/base")
        adapted = get_peft_model(base, LoraConfig(r=2, target_modules=["query"], task_type="SEQ_CLS"))
        with torch.no_grad():
            adapted.base_model.model.classifier.modules_to_save["default"].weight.add_(1.0)
        adapted.save_pretrained(f"{folder}/adapter")
        ids = torch.arange(1, 6)[None]
        expected = adapted(input_ids=ids).logits
        native = transformers.BertForSequenceClassification.from_pretrained(f"{folder}/base").eval()
        native.load_adapter(f"{folder}/adapter")
        return bool(torch.allclose(native(input_ids=ids).logits, expected, atol=1e-6))


def test_adapter_saves_and_loads(trained):
    _, peft_model, root, batch, _, _, _ = trained
    saved = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert set(saved["target_modules"]) == set(LORA_TARGETS)
    assert (root / "adapter" / "adapter_model.safetensors").is_file()
    expected = _logits(peft_model, batch)
    base_class = type(peft_model.get_base_model())

    reloaded = PeftModel.from_pretrained(base_class.from_pretrained(root / "base"), root / "adapter").eval()
    assert (_logits(reloaded, batch) - expected).abs().max().item() <= 1e-6

    # transformers' own PEFT integration: PreTrainedModel.load_adapter
    if saved.get("modules_to_save") and not load_adapter_restores_task_heads():
        pytest.skip(f"transformers {transformers.__version__}'s load_adapter leaves a modules_to_save head (here "
                    f"{saved['modules_to_save']}) at its base weights, for official BERT as for us")
    native = base_class.from_pretrained(root / "base").eval()
    native.load_adapter(str(root / "adapter"))
    assert (_logits(native, batch) - expected).abs().max().item() <= 1e-6


# PEFT's messages (peft 0.21): a plain model names the targets it could not find; a model with a task head that
# PEFT keeps trainable (SEQ_CLS -> modules_to_save=["classifier", "score"]) gets a generic message instead.
NO_MATCH_ERRORS = {
    "causal": r"Target modules \{.*'query'.*\} not found in the base model",
    "seq2seq": r"Target modules \{.*'query'.*\} not found in the base model",
    "encoder": r"No modules were targeted for adaptation.*check your `target_modules`",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_target_modules_matching_nothing_is_a_clear_error(family):
    model, task_type = FAMILIES[family]()
    # BERT's own names (query/value) do not exist in hf_tiny
    config = LoraConfig(r=4, target_modules=["query", "value"], task_type=task_type)
    with pytest.raises(ValueError, match=NO_MATCH_ERRORS[family]):
        get_peft_model(model, config)


# Gemma scales its token embeddings by sqrt(hidden_size) inside the embedding module (official's
# Gemma3TextScaledWordEmbedding, ours layers.ScaledEmbedding): PEFT's prompt tuning embeds ids through
# get_input_embeddings() and passes inputs_embeds, and its LoRA on the embedding scales the adapter's rows by the
# module's embed_scale. Both must compute what they compute on official Gemma 3.


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    from causal_helpers import official_and_converted, tiny_official

    folders = official_and_converted(tiny_official("gemma3_text"), tmp_path_factory.mktemp("gemma_peft"))
    load = transformers.AutoModelForCausalLM.from_pretrained
    return {side: load(folders / side, attn_implementation="eager").eval() for side in ("official", "ours")}


def _gemma_logits(model, peft_config, ids):
    torch.manual_seed(3)  # the adapter's own initial values, the same on both sides
    adapted = get_peft_model(model, peft_config)
    for name, param in adapted.named_parameters():  # LoRA's B starts at zero: give the adapter an effect
        if param.requires_grad:
            torch.nn.init.normal_(param, std=0.5, generator=torch.Generator().manual_seed(len(name)))
    with torch.no_grad():
        return adapted(input_ids=ids).logits


@pytest.mark.parametrize("method", ["prompt tuning", "lora on embed_tokens"])
def test_gemma_embedding_scale_reaches_peft_as_on_official(gemma_pair, method):
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    ours, official = gemma_pair["ours"], gemma_pair["official"]
    embeddings = ours.get_input_embeddings()(ids)
    assert torch.equal(embeddings, official.get_input_embeddings()(ids))
    with torch.no_grad():
        assert torch.equal(ours(inputs_embeds=embeddings).logits, ours(input_ids=ids).logits)

    def config():
        if method == "prompt tuning":
            return PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
        return LoraConfig(target_modules=["embed_tokens"], r=4, lora_alpha=8)

    produced = _gemma_logits(copy.deepcopy(ours), config(), ids)
    expected = _gemma_logits(copy.deepcopy(official), config(), ids)
    assert (produced - expected).abs().max() <= 1e-4 * max(1.0, expected.abs().max())
    # negative control: without the adapter the logits are others
    with torch.no_grad():
        plain = ours(input_ids=ids).logits
    assert (plain - produced[:, -ids.shape[1]:]).abs().max() > 1e-2


def _lora_grads_with_reentrant_checkpointing(model, batch: dict) -> dict:
    """What prepare_model_for_kbit_training sets up (input grads on, reentrant checkpointing) plus LoRA: one
    backward's adapter gradients, under names without PEFT's prefix."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                                  task_type="SEQ_2_SEQ_LM"))
    adapters = {_lora_name(name): param for name, param in peft_model.named_parameters() if "lora_" in name}
    with torch.no_grad():  # the same adapter values on both sides, by name (module orders differ)
        for name, param in adapters.items():
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))))
    peft_model.train()
    peft_model(**batch).loss.backward()
    return {name: param.grad for name, param in adapters.items()}


def _lora_name(name: str) -> str:
    """A LoRA parameter's name under PEFT's prefix, with official BART's cross-attention name made ours."""
    return name.split("model.", 2)[-1].replace("encoder_attn", "cross_attn")


def test_seq2seq_lora_with_reentrant_checkpointing_trains_as_official_bart(tmp_path, monkeypatch):
    """enable_input_require_grads hooks the embeddings each stack's forward calls (official's are PreTrainedModels of
    their own; ours are plain stacks), so QLoRA's default set-up trains the adapters as on official BART; before, the
    loss had no grad_fn. Negative control: with transformers' hooks alone (on `shared`), the loss needs no grad."""
    from bart_models import make_official_bart, padded_batch

    from conversion import bart

    make_official_bart(tmp_path / "official")
    bart.convert(tmp_path / "official", tmp_path / "ours")
    official = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "official")
    batch = padded_batch(official.config)
    batch["labels"] = batch.pop("decoder_input_ids").masked_fill(batch.pop("decoder_attention_mask") == 0, -100)
    ours = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours")
    torch.manual_seed(0)
    expected = _lora_grads_with_reentrant_checkpointing(official, batch)
    torch.manual_seed(0)
    got = _lora_grads_with_reentrant_checkpointing(ours, batch)
    assert len(got) == len(expected) == 2 * 2 * (2 + 2 * 3)  # A and B of q/v: encoder self, decoder self + cross
    for name, grad in got.items():
        assert grad is not None and grad.abs().max() > 0, name
        # relative to the tensor's largest gradient: an Intel Xeon (family 6 model 167) rounded one element of 64
        # 3.6e-6 away (1.9e-4 of it), also at the commit CI passed with
        scale = float(expected[name].abs().max())
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-4 * scale)

    monkeypatch.setattr(hf_tiny.TinySeq2SeqPreTrainedModel, "enable_input_require_grads",
                        transformers.PreTrainedModel.enable_input_require_grads)
    plain = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours")
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    plain.enable_input_require_grads()
    peft_model = get_peft_model(plain, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_2_SEQ_LM"))
    peft_model.train()
    assert not peft_model(**batch).loss.requires_grad

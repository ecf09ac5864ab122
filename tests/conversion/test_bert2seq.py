"""bert2seq: warm-starting encoder and decoder from one BERT checkpoint must give the model transformers'
EncoderDecoderModel.from_encoder_decoder_pretrained builds. The reference is built independently here (another
seed); the tensors that both sides initialize newly (cross-attention, LM-head transform) are copied from ours into
it, then logits and greedy decoding are compared. Every other tensor must have come from the checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, BertConfig, BertModel, EncoderDecoderModel

import hf_tiny  # noqa: F401  (registers the Auto classes)
from conversion import ConversionError, bert2seq

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Attention is all you need.",
    "A converted checkpoint holds the same numbers under different names, and they must agree.",
)
TARGETS = ("a fox jumps.", "attention is all you need, they said, and it was mostly right.", "same numbers.")

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def official_warm_start(src, seed: int):
    torch.manual_seed(seed)
    return EncoderDecoderModel.from_encoder_decoder_pretrained(str(src), str(src)).eval()


def copy_new_tensors(ours, official) -> None:
    """The tensors EncoderDecoderModel initializes newly, written in official naming (independent of the converter)."""
    with torch.no_grad():
        for j, layer in enumerate(official.decoder.bert.encoder.layer):
            mine = ours.model.decoder.layers[j]
            pairs = [
                (layer.crossattention.self.query, mine.cross_attn.q_proj),
                (layer.crossattention.self.key, mine.cross_attn.k_proj),
                (layer.crossattention.self.value, mine.cross_attn.v_proj),
                (layer.crossattention.output.dense, mine.cross_attn.o_proj),
                (layer.crossattention.output.LayerNorm, mine.cross_attn_layernorm),
            ]
            for theirs, source in pairs:
                theirs.weight.copy_(source.weight)
                theirs.bias.copy_(source.bias)
        transform = official.decoder.cls.predictions.transform
        for theirs, source in ((transform.dense, ours.lm_head_transform.dense), (transform.LayerNorm, ours.lm_head_transform.norm)):
            theirs.weight.copy_(source.weight)
            theirs.bias.copy_(source.bias)
        official.decoder.cls.predictions.bias.copy_(ours.lm_head.bias)


def real_logit_diff(ours, official, batch) -> float:
    with torch.no_grad():
        a = ours(**batch).logits
        b = official(**batch).logits
    real = batch["decoder_attention_mask"].bool()
    return float((a[real] - b[real]).abs().max())


def check_warm_start(ours, bert_state: dict, prefix: str = "") -> None:
    """Encoder and decoder carry the checkpoint's tensors; the new ones look like transformers' init."""
    config = ours.config
    words = bert_state[f"{prefix}embeddings.word_embeddings.weight"]
    assert torch.equal(ours.model.shared.weight, words) and torch.equal(ours.model.decoder.embed_tokens.weight, words)
    assert ours.model.decoder.embed_tokens.weight is not ours.model.shared.weight  # separate tables, as upstream
    assert ours.lm_head.weight is ours.model.decoder.embed_tokens.weight  # BertLMHeadModel ties its decoder
    for stack in (ours.model.encoder, ours.model.decoder):
        assert torch.equal(stack.embed_positions.weight, bert_state[f"{prefix}embeddings.position_embeddings.weight"])
        assert torch.equal(stack.token_type_embeddings.weight, bert_state[f"{prefix}embeddings.token_type_embeddings.weight"])
        for i, layer in enumerate(stack.layers):
            official = f"{prefix}encoder.layer.{i}."
            assert torch.equal(layer.self_attn.q_proj.weight, bert_state[official + "attention.self.query.weight"])
            assert torch.equal(layer.mlp.down_proj.bias, bert_state[official + "output.dense.bias"])
            assert torch.equal(layer.post_attention_layernorm.weight, bert_state[official + "output.LayerNorm.weight"])
    cross = torch.cat([layer.cross_attn.q_proj.weight.flatten() for layer in ours.model.decoder.layers])
    assert abs(float(cross.detach().std()) - config.initializer_range) < 0.1 * config.initializer_range
    for layer in ours.model.decoder.layers:
        assert not layer.cross_attn.k_proj.bias.any() and bool((layer.cross_attn_layernorm.weight == 1).all())


# ---------------------------------------------------------------------------------------------------------------
# tiny random BERT (fast)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
                        max_position_embeddings=32, initializer_range=0.2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    path = tmp_path_factory.mktemp("bert") / "tiny_bert"
    model.save_pretrained(path)
    dst = tmp_path_factory.mktemp("bert2seq") / "ours"
    result = bert2seq.convert(path, dst)
    return path, dst, result


def tiny_batch():
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(1, 40, (3, 10), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    attention_mask[2, 4:] = 0
    decoder_input_ids = torch.randint(1, 40, (3, 6), generator=generator)
    decoder_attention_mask = torch.ones_like(decoder_input_ids)
    decoder_attention_mask[2, 3:] = 0
    return {
        "input_ids": input_ids * attention_mask,
        "attention_mask": attention_mask,
        "decoder_input_ids": decoder_input_ids * decoder_attention_mask,
        "decoder_attention_mask": decoder_attention_mask,
    }


@pytest.mark.parametrize("backend", ("eager", "sdpa"))
def test_tiny_bert2seq_matches_encoder_decoder_model(tiny_bert, backend):
    src, dst, _ = tiny_bert
    ours = AutoModelForSeq2SeqLM.from_pretrained(dst, attn_implementation=backend).eval()
    official = official_warm_start(src, seed=1234)
    official.set_attn_implementation(backend)
    batch = tiny_batch()
    # negative control: the independently drawn cross-attention gives other logits
    assert real_logit_diff(ours, official, batch) > 1e-2
    copy_new_tensors(ours, official)
    diff = real_logit_diff(ours, official, batch)
    print(f"bert2seq tiny {backend}: max |Δ logits| = {diff:.3g}")
    assert diff <= 1e-5


def test_tiny_bert2seq_carries_the_checkpoint(tiny_bert):
    src, dst, result = tiny_bert
    ours = AutoModelForSeq2SeqLM.from_pretrained(dst)
    check_warm_start(ours, load_file(src / "model.safetensors"))
    assert ours.config.decoder_start_token_id is None  # no tokenizer in this folder to name [CLS]
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])


def test_bert2seq_rejects_non_bert_and_leaves_dst_untouched(tiny_bert, tmp_path):
    _, dst, _ = tiny_bert
    with pytest.raises(ConversionError, match="is not a bert checkpoint: its config.json has model_type='hf_tiny_seq2seq'"):
        bert2seq.convert(dst, tmp_path / "never")
    assert not (tmp_path / "never").exists()


# ---------------------------------------------------------------------------------------------------------------
# the real all-MiniLM-L6-v2 checkpoint
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_bert2seq(real_minilm_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("minilm") / "bert2seq"
    result = bert2seq.convert(real_minilm_dir, dst)
    return real_minilm_dir, dst, result


def minilm_batch(src):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src))
    sources = tokenizer(list(SENTENCES), padding=True, return_tensors="pt")
    targets = tokenizer(list(TARGETS), padding=True, return_tensors="pt")  # [CLS] ... [SEP]: [CLS] starts decoding
    return {
        "input_ids": sources["input_ids"],
        "attention_mask": sources["attention_mask"],
        "decoder_input_ids": targets["input_ids"],
        "decoder_attention_mask": targets["attention_mask"],
    }


@pytest.mark.real_weights
@pytest.mark.slow
def test_minilm_bert2seq_matches_encoder_decoder_model(minilm_bert2seq):
    src, dst, result = minilm_bert2seq
    ours = AutoModelForSeq2SeqLM.from_pretrained(dst, attn_implementation="eager").eval()
    assert (ours.config.decoder_start_token_id, ours.config.eos_token_id, ours.config.pad_token_id) == (101, 102, 0)
    check_warm_start(ours, load_file(src / "model.safetensors"))
    official = official_warm_start(src, seed=1234)
    batch = minilm_batch(src)
    assert (batch["attention_mask"] == 0).any() and (batch["decoder_attention_mask"] == 0).any()
    official.set_attn_implementation("eager")
    assert real_logit_diff(ours, official, batch) > 1e-2  # negative control: other new weights, other logits
    copy_new_tensors(ours, official)
    for backend in ("eager", "sdpa"):
        official.set_attn_implementation(backend)
        ours.set_attn_implementation(backend)
        diff = real_logit_diff(ours, official, batch)
        print(f"bert2seq MiniLM {backend}: max |Δ logits| = {diff:.3g}")
        assert diff <= 1e-4, f"{backend}: max |Δ logits| = {diff}"

    official.config.decoder_start_token_id, official.config.pad_token_id = 101, 0
    official.config.eos_token_id = 102
    official.generation_config.decoder_start_token_id, official.generation_config.pad_token_id = 101, 0
    official.generation_config.eos_token_id = 102
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=8, do_sample=False)
    assert ours.generate(**kwargs).tolist() == official.generate(**kwargs).tolist()
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])

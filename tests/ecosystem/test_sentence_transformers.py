"""sentence-transformers on the converted all-MiniLM-L6-v2: Transformer(converted folder) + mean Pooling +
Normalize gives the embeddings of the original SentenceTransformer (cosine >= 0.99999), and survives ST's own
save / load."""

from __future__ import annotations

import json

import pytest
import torch

import hf_tiny

SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog near the bank of the river this morning.",
    "hi",
    "Sentence embeddings map text to vectors; similar meanings end up close together.",
]

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def converted_minilm(real_minilm_dir, tmp_path_factory):
    from conversion import bert

    dst = tmp_path_factory.mktemp("st") / "minilm"
    bert.convert(real_minilm_dir, dst)
    return dst


def _ours(converted, real_minilm_dir):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    # the original's sentence_bert_config.json truncates at 256 tokens: use the same limit
    max_seq_length = json.loads((real_minilm_dir / "sentence_bert_config.json").read_text())["max_seq_length"]
    transformer = Transformer(str(converted), max_seq_length=max_seq_length)
    assert isinstance(transformer.auto_model, hf_tiny.TinyEncoderModel)
    pooling = Pooling(transformer.auto_model.config.hidden_size, pooling_mode="mean")
    return SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu")


@pytest.mark.slow
@pytest.mark.real_weights
def test_converted_minilm_matches_original_sentence_transformer(converted_minilm, real_minilm_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    original = SentenceTransformer(str(real_minilm_dir), device="cpu")
    ours = _ours(converted_minilm, real_minilm_dir)
    assert ours.max_seq_length == original.max_seq_length

    expected = original.encode(SENTENCES, convert_to_tensor=True, batch_size=4)  # one padded batch
    got = ours.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    cosine = torch.nn.functional.cosine_similarity(got, expected)
    assert cosine.min().item() >= 0.99999, cosine
    assert (got - expected).abs().max().item() <= 1e-5
    # negative control: the same comparison notices a different sentence
    shifted = ours.encode(SENTENCES[1:] + SENTENCES[:1], convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(shifted, expected).min().item() < 0.99

    # sentence-transformers' own save/load round trip keeps the hf_tiny model and the embeddings
    ours.save(str(tmp_path / "st_model"))
    reloaded = SentenceTransformer(str(tmp_path / "st_model"), device="cpu")
    assert isinstance(reloaded[0].auto_model, hf_tiny.TinyEncoderModel)
    again = reloaded.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    assert (again - got).abs().max().item() <= 1e-6


@pytest.mark.slow
@pytest.mark.real_weights
def test_converted_folder_is_the_same_sentence_transformer(converted_minilm, real_minilm_dir):
    """SentenceTransformer(converted folder) as it is: the pooling and normalisation modules and max_seq_length
    256 travel with the conversion (they used to be dropped: unnormalized embeddings, dot product 28.8 vs 0.908)."""
    from sentence_transformers import SentenceTransformer

    assert {"modules.json", "sentence_bert_config.json", "1_Pooling"} <= {p.name for p in converted_minilm.iterdir()}
    original = SentenceTransformer(str(real_minilm_dir), device="cpu")
    ours = SentenceTransformer(str(converted_minilm), device="cpu")
    assert isinstance(ours[0].auto_model, hf_tiny.TinyEncoderModel)
    assert ours.max_seq_length == original.max_seq_length == 256
    expected = original.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    got = ours.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    dots, expected_dots = got @ got.T, expected @ expected.T
    assert (dots - expected_dots).abs().max().item() <= 1e-5
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)
    # negative control: the bare encoder with default mean pooling is not normalized
    bare = SentenceTransformer(modules=[ours[0], ours[1]], device="cpu").encode(SENTENCES, convert_to_tensor=True)
    assert (bare @ bare.T - expected_dots).abs().max().item() > 1.0


@pytest.mark.slow
@pytest.mark.real_weights
def test_roberta_based_sentence_transformer_converts_to_the_same_model(real_minilm_dir, tmp_path):
    """A RoBERTa-architecture sentence model (tiny random weights, MiniLM's tokenizer and ST modules: pad id 0,
    so RoBERTa's positions start at 1) converts to the same SentenceTransformer: modules, pooling, normalization."""
    import shutil

    import transformers
    from sentence_transformers import SentenceTransformer

    from conversion import roberta

    config = transformers.RobertaConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=300, type_vocab_size=1, pad_token_id=0, initializer_range=0.2,
    )
    torch.manual_seed(0)
    src = tmp_path / "st_roberta"
    transformers.RobertaModel(config, add_pooling_layer=False).save_pretrained(src)
    for entry in real_minilm_dir.iterdir():
        if entry.name in ("config.json", "model.safetensors") or entry.suffix in (".onnx", ".bin", ".h5", ".ot"):
            continue
        if entry.is_dir() and entry.name.startswith(("1_", "2_")):
            shutil.copytree(entry, src / entry.name)
        elif entry.is_file():
            shutil.copy2(entry, src / entry.name)
    roberta.convert(src, tmp_path / "ours")
    assert {"modules.json", "sentence_bert_config.json", "1_Pooling"} <= {p.name for p in (tmp_path / "ours").iterdir()}

    original = SentenceTransformer(str(src), device="cpu")
    ours = SentenceTransformer(str(tmp_path / "ours"), device="cpu")
    assert isinstance(ours[0].auto_model, hf_tiny.TinyEncoderModel) and ours[0].auto_model.config.positions_from_padding
    expected = original.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    got = ours.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    assert (got - expected).abs().max().item() <= 1e-5
    # negative control: BERT-style positions (from 0) give other embeddings
    ours[0].auto_model.config.positions_from_padding = False
    wrong = ours.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    assert (wrong - expected).abs().max().item() > 1e-3

"""BART (and Marian, BART's layout with sinusoidal positions) -> hf_tiny through the production converter, then
the same padded inputs through both: logits, greedy and beam search must match the official models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, BartForConditionalGeneration, MarianConfig, MarianMTModel

import hf_tiny  # noqa: F401  (registers the Auto classes)
from conversion import ConversionError, bart
from bart_models import randomize_norms, make_official_bart, padded_batch

BACKENDS = ("eager", "sdpa")
TOLERANCE = 1e-5  # fp32, tiny random models

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def make_official_marian(path: Path, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=64, d_model=16, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=40, init_std=0.3,
        dropout=0.0, pad_token_id=63, decoder_start_token_id=63, eos_token_id=0, forced_eos_token_id=0,
        scale_embedding=True, activation_function="swish",
    )
    config = MarianConfig(**{**fields, **overrides})
    model = MarianMTModel(config).eval()
    randomize_norms(model)
    model.save_pretrained(path)
    return path


def real_logit_diff(ours, official, batch) -> float:
    """max |Δ logits| over real decoder positions (padded positions are never used)."""
    with torch.no_grad():
        a = ours(**batch, use_cache=False).logits
        b = official(**batch, use_cache=False).logits
    real = batch["decoder_attention_mask"].bool()
    return float((a[real] - b[real]).abs().max())


@pytest.fixture(scope="module")
def bart_pair(tmp_path_factory):
    src = make_official_bart(tmp_path_factory.mktemp("bart") / "official")
    dst = tmp_path_factory.mktemp("bart_converted") / "hf_tiny"
    result = bart.convert(src, dst)
    return src, dst, result


@pytest.mark.parametrize("backend", BACKENDS)
def test_bart_logits_match_official_on_padded_batch(bart_pair, backend):
    src, dst, _ = bart_pair
    official = BartForConditionalGeneration.from_pretrained(src, attn_implementation=backend).eval()
    ours = AutoModelForSeq2SeqLM.from_pretrained(dst, attn_implementation=backend).eval()
    assert type(ours).__name__ == "TinySeq2SeqForConditionalGeneration"
    batch = padded_batch(ours.config)
    diff = real_logit_diff(ours, official, batch)
    print(f"BART {backend}: max |Δ logits| = {diff:.3g}")
    assert diff <= TOLERANCE, f"{backend}: max |Δ logits| = {diff}"
    with torch.no_grad():
        ours_enc = ours(**batch).encoder_last_hidden_state
        official_enc = official(**batch).encoder_last_hidden_state
    real = batch["attention_mask"].bool()
    assert float((ours_enc[real] - official_enc[real]).abs().max()) <= TOLERANCE


def test_bart_forward_of_input_ids_alone_shifts_them_as_official(bart_pair, tmp_path):
    """model(input_ids).logits, BART's denoising / mask-filling call: official shifts input_ids right into the
    decoder's input. Negative control: a folder converted before the converter set decoder_inputs_from_input_ids
    refuses, naming the way out (as Marian and T5, which official refuses too)."""
    src, dst, _ = bart_pair
    official = BartForConditionalGeneration.from_pretrained(src).eval()
    ours = AutoModelForSeq2SeqLM.from_pretrained(dst).eval()
    batch = padded_batch(ours.config)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        expected, got = official(**inputs).logits, ours(**inputs).logits
    assert float((got - expected).abs().max()) <= TOLERANCE
    config = json.loads((dst / "config.json").read_text())
    assert config["decoder_inputs_from_input_ids"] is True
    older = AutoModelForSeq2SeqLM.from_pretrained(dst, decoder_inputs_from_input_ids=False).eval()
    with pytest.raises(ValueError, match="pass decoder_input_ids"):
        older(**inputs)


def test_bart_negative_controls_are_rejected(bart_pair):
    """The same comparison must catch a wrong variant: it is not passing by smallness of the numbers."""
    src, dst, _ = bart_pair
    official = BartForConditionalGeneration.from_pretrained(src, attn_implementation="eager").eval()
    batch = padded_batch(official.config)
    for wrong in ({"scale_embedding": True}, {"attention_scale": 1.0}, {"norm_placement": "pre"}):
        ours = AutoModelForSeq2SeqLM.from_pretrained(dst, attn_implementation="eager", **wrong).eval()
        assert real_logit_diff(ours, official, batch) > 1e-2, wrong
    ours = AutoModelForSeq2SeqLM.from_pretrained(dst, attn_implementation="eager").eval()
    with torch.no_grad():
        ours.final_logits_bias.zero_()  # a dropped bias
    assert real_logit_diff(ours, official, batch) > 1e-2


@pytest.mark.parametrize("num_beams", (1, 3))
def test_bart_generate_matches_official(bart_pair, num_beams):
    src, dst, _ = bart_pair
    official = BartForConditionalGeneration.from_pretrained(src).eval()
    ours = AutoModelForSeq2SeqLM.from_pretrained(dst).eval()
    batch = padded_batch(ours.config)
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=10,
                  num_beams=num_beams, do_sample=False)
    expected = official.generate(**kwargs)
    produced = ours.generate(**kwargs)
    assert produced.tolist() == expected.tolist()
    assert expected.shape[1] > 3  # something was generated


def test_bart_reverse_is_bit_exact_and_loads_cleanly(bart_pair, tmp_path):
    src, dst, _ = bart_pair
    back = tmp_path / "back"
    bart.convert_back(dst, back)
    original, returned = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(original) == sorted(returned)
    assert all(torch.equal(original[k], returned[k]) for k in original)
    _, info = BartForConditionalGeneration.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())


@pytest.mark.parametrize("make", [make_official_bart, make_official_marian], ids=["bart", "marian"])
def test_stacks_with_their_own_heads_and_ffn_sizes(make, tmp_path):
    """decoder_attention_heads / decoder_ffn_dim that differ from the encoder's: parity with the official model on
    every backend, generate identical, reverse bit-exact (a model with one head count for both stacks fails it)."""
    overrides = dict(encoder_attention_heads=4, decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=40)
    src = make(tmp_path / "official", seed=5, **overrides)
    result = bart.convert(src, tmp_path / "ours")
    ours_config = result["config"]
    assert (ours_config.num_attention_heads, ours_config.decoder_attention_heads) == (4, 2)
    assert (ours_config.intermediate_size, ours_config.decoder_intermediate_size) == (24, 40)
    official_class = type(AutoModelForSeq2SeqLM.from_pretrained(src))
    official = official_class.from_pretrained(src, attn_implementation="eager").eval()
    batch = padded_batch(official.config)
    for backend in BACKENDS:
        ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours", attn_implementation=backend).eval()
        assert real_logit_diff(ours, official, batch) <= TOLERANCE, backend
    assert ours.model.decoder.layers[0].self_attn.num_heads == 2 and ours.model.encoder.layers[0].self_attn.num_heads == 4
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=8, num_beams=2)
    assert ours.generate(**kwargs).tolist() == official.generate(**kwargs).tolist()
    # negative control: the decoder's heads regrouped as the encoder's (same weights, 4 heads of 4) is far off
    same_heads = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours", decoder_attention_heads=4,
                                                       decoder_head_dim=4, attn_implementation="eager").eval()
    assert real_logit_diff(same_heads, official, batch) > 1e-2
    bart.convert_back(tmp_path / "ours", tmp_path / "back")
    original, returned = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert all(torch.equal(original[k], returned[k]) for k in original)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back["decoder_attention_heads"], back["decoder_ffn_dim"]) == (2, 40)


def test_bart_folder_and_model_card(bart_pair):
    _, dst, result = bart_pair
    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "hf_tiny_seq2seq"
    assert config["auto_map"]["AutoModelForSeq2SeqLM"] == "modeling_seq2seq.TinySeq2SeqForConditionalGeneration"
    assert (dst / "modeling_seq2seq.py").is_file() and (dst / "generation_config.json").is_file()
    generation = json.loads((dst / "generation_config.json").read_text())
    assert generation["forced_eos_token_id"] == 2 and generation["decoder_start_token_id"] == 2
    card = (dst / "README.md").read_text()
    assert "| eager | float32 | cpu |" in card and "| sdpa | float32 | cpu |" in card
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])


# Generation fields checkpoints saved before transformers 4.26 keep in config.json (and no generation_config.json)
LEGACY_GENERATION = {"num_beams": 3, "no_repeat_ngram_size": 2, "length_penalty": 2.0, "min_length": 3,
                     "forced_bos_token_id": 5, "max_length": 12}


def test_a_folder_without_generation_config_generates_as_official_reads_its_config_json(tmp_path):
    """Official from_pretrained takes such a folder's generation fields from config.json; the converted folder's
    generation_config.json carries them (before: BART's forced_eos_token_id and every legacy field were lost, and
    default generate() decoded otherwise)."""
    src = make_official_bart(tmp_path / "official")
    (src / "generation_config.json").unlink()
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **LEGACY_GENERATION}))
    bart.convert(src, tmp_path / "ours")
    official = BartForConditionalGeneration.from_pretrained(src).eval()
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours").eval()
    for field in (*LEGACY_GENERATION, "forced_eos_token_id", "decoder_start_token_id"):
        assert getattr(ours.generation_config, field) == getattr(official.generation_config, field), field
    input_ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    assert ours.generate(input_ids).tolist() == official.generate(input_ids).tolist()


def test_bart_untied_head_parity(tmp_path):
    src = make_official_bart(tmp_path / "official", seed=3)
    state = load_file(src / "model.safetensors")
    # an untied head (e.g. after fine-tuning with tie_word_embeddings=False)
    from safetensors.torch import save_file

    state["lm_head.weight"] = torch.randn_like(state["model.shared.weight"])
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    official = BartForConditionalGeneration.from_pretrained(src).eval()
    assert not torch.equal(official.lm_head.weight, official.model.shared.weight)
    bart.convert(src, tmp_path / "ours")
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours").eval()
    assert ours.config.tie_word_embeddings is False
    assert real_logit_diff(ours, official, padded_batch(ours.config)) <= TOLERANCE


@pytest.mark.parametrize("bare", ["BartModel", "MarianModel"])
def test_a_bare_base_model_converts_as_auto_seq2seq_lm_loads_it(bare, tmp_path):
    """A bare BartModel / MarianModel folder stores its tensors without the `model.` prefix and has no LM head;
    official AutoModelForSeq2SeqLM loads it as the ForConditionalGeneration class with the head tied to the
    embeddings. Before, the converter said "missing tensor model.shared.weight"."""
    import transformers

    make = make_official_marian if bare == "MarianModel" else make_official_bart
    full = AutoModelForSeq2SeqLM.from_pretrained(make(tmp_path / "full", seed=5)).eval()
    base = getattr(transformers, bare)(full.config)
    base.load_state_dict(full.model.state_dict())
    base.save_pretrained(tmp_path / "bare")
    assert not any(key.startswith("model.") for key in load_file(tmp_path / "bare" / "model.safetensors"))
    result = bart.convert(tmp_path / "bare", tmp_path / "ours")
    official = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "bare").eval()
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours").eval()
    batch = padded_batch(ours.config)
    assert real_logit_diff(ours, official, batch) <= TOLERANCE
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])
    assert f"bare `{bare}` (no `model.` prefix, no LM head)" in (tmp_path / "ours" / "README.md").read_text()
    # negative control: one weight changed (the last encoder layer's output projection zeroed)
    with torch.no_grad():
        ours.model.encoder.layers[-1].self_attn.o_proj.weight.zero_()
    assert real_logit_diff(ours, official, batch) > 1e-3


def test_bart_with_separate_embedding_tables_is_refused_naming_them(tmp_path):
    """tie_word_embeddings=False: transformers 5 keeps BART's shared, encoder and decoder tables apart; hf_tiny has
    one table for both stacks, so the converter refuses, naming the tables (before: "... but they are tied")."""
    src = make_official_bart(tmp_path / "official", seed=2, tie_word_embeddings=False)
    official = BartForConditionalGeneration.from_pretrained(src)
    assert not torch.equal(official.model.encoder.embed_tokens.weight, official.model.shared.weight)
    with pytest.raises(ConversionError, match=r"tie_word_embeddings=False and model\.encoder\.embed_tokens\.weight, "
                                              r"model\.decoder\.embed_tokens\.weight differ from model\.shared\.weight"):
        bart.convert(src, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("field", ["encoder_layerdrop", "decoder_layerdrop"])
def test_layerdrop_is_refused_by_name(field, tmp_path):
    """Official BART skips whole layers at random in training with layerdrop; hf_tiny's layers never skip, so a
    config with it is refused rather than trained silently otherwise (eval would match)."""
    src = make_official_bart(tmp_path / "official", **{field: 0.3})
    with pytest.raises(ConversionError, match=rf"{field}=0.3 is not supported"):
        bart.convert(src, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


def test_marian_sinusoidal_positions_match_official(tmp_path):
    src = make_official_marian(tmp_path / "marian")
    dst = tmp_path / "ours"
    bart.convert(src, dst)
    official = MarianMTModel.from_pretrained(src, attn_implementation="eager").eval()
    ours = AutoModelForSeq2SeqLM.from_pretrained(dst, attn_implementation="eager").eval()
    assert ours.config.position_embedding_type == "sinusoidal" and ours.config.num_decoder_layers == 2
    batch = padded_batch(ours.config)
    diff = real_logit_diff(ours, official, batch)
    print(f"Marian eager: max |Δ logits| = {diff:.3g}")
    assert diff <= TOLERANCE
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=8, do_sample=False)
    assert ours.generate(**kwargs, num_beams=2).tolist() == official.generate(**kwargs, num_beams=2).tolist()
    back = tmp_path / "back"
    bart.convert_back(dst, back)
    original, returned = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(original) == sorted(returned) and all(torch.equal(original[k], returned[k]) for k in original)


# MarianTokenizer's VOCAB_FILES_NAMES (transformers/models/marian/tokenization_marian.py, which needs sentencepiece to
# import), as every Helsinki-NLP/opus-mt-* repository ships them
MARIAN_TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json", "tokenizer_config.json")


def test_marian_tokenizer_files_travel_both_ways(tmp_path):
    """Every file MarianTokenizer reads (its vocab_files_names: one SentencePiece model per language, the vocabularies)
    is copied to the converted folder and back, byte for byte, and the card names them; before, source.spm,
    target.spm and target_vocab.json stayed behind and the converted folder's tokenizer could not load."""
    src = make_official_marian(tmp_path / "marian")
    for number, name in enumerate(sorted(MARIAN_TOKENIZER_FILES)):
        (src / name).write_bytes(f"{name} {number}".encode())  # stand-ins: sentencepiece is not a test dependency
    bart.convert(src, tmp_path / "ours")
    bart.convert_back(tmp_path / "ours", tmp_path / "back")
    card = (tmp_path / "ours" / "README.md").read_text()
    for name in MARIAN_TOKENIZER_FILES:
        assert (tmp_path / "ours" / name).read_bytes() == (src / name).read_bytes(), name
        assert (tmp_path / "back" / name).read_bytes() == (src / name).read_bytes(), name
        assert name in card, name


def test_bart_failures_are_clear_and_leave_dst_untouched(bart_pair, tmp_path):
    src, _, _ = bart_pair
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists"):
        bart.convert(src, existing)
    assert sorted(p.name for p in existing.iterdir()) == ["keep.txt"]

    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((src / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "decoder_ffn_dim": 48}))
    (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    # a config that disagrees with its tensors: the shape check names the tensor and both shapes
    with pytest.raises(ConversionError, match=r"wrong shapes: model\.decoder\.layers\.0\.mlp\.down_proj\.weight \(expected \(16, 48\), got \(16, 32\)\)"):
        bart.convert(bad, tmp_path / "never")
    assert not (tmp_path / "never").exists()

    state = load_file(src / "model.safetensors")
    state.pop("model.encoder.layers.1.fc2.weight")
    from safetensors.torch import save_file

    (bad / "config.json").write_text(json.dumps(config))
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"model\.encoder\.layers\.1\.fc2\.weight"):
        bart.convert(bad, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    assert not any(p.name.startswith(".never") for p in tmp_path.iterdir())


def test_bart_cli_both_directions(bart_pair, tmp_path, capsys):
    """`python -m conversion bart SRC DST [--reverse]` (its main(), in-process): success lines, one-line errors."""
    from conversion.__main__ import main

    src, _, _ = bart_pair
    assert main(["bart", str(src), str(tmp_path / "ours")]) == 0
    assert main(["bart", str(tmp_path / "ours"), str(tmp_path / "back"), "--reverse"]) == 0
    assert (tmp_path / "back" / "model.safetensors").is_file()
    capsys.readouterr()
    # an hf_tiny folder is not a BART checkpoint
    assert main(["bart", str(tmp_path / "ours"), str(tmp_path / "again")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "model_type='hf_tiny_seq2seq'" in err and "Traceback" not in err
    assert not (tmp_path / "again").exists()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("backend", ("eager", "sdpa", "flash_attention_2"))
def test_bart_cuda_parity(bart_pair, backend, dtype, tolerance):
    """On CUDA: ours in dtype with each backend vs the official fp32 model; tolerance relative to max |logits|.
    flash_attention_2 runs in fp16/bf16 on CUDA: in fp32 a clear error."""
    src, dst, _ = bart_pair
    official = BartForConditionalGeneration.from_pretrained(src, attn_implementation="eager").eval().cuda()
    ours = AutoModelForSeq2SeqLM.from_pretrained(dst, attn_implementation=backend, dtype=dtype).eval().cuda()
    batch = {k: v.cuda() for k, v in padded_batch(ours.config).items()}
    if backend == "flash_attention_2" and dtype == torch.float32:
        with pytest.raises(ValueError, match="runs in float16 or bfloat16 on cuda"):
            ours(**batch)
        return
    with torch.no_grad():
        a = ours(**batch).logits.float()
        b = official(**batch).logits
    real = batch["decoder_attention_mask"].bool()
    scale = max(1.0, float(b[real].abs().max()))
    assert float((a[real] - b[real]).abs().max()) <= tolerance * scale

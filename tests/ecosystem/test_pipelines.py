"""transformers pipelines on hf_tiny models: tiny models with real tokenizers (all-MiniLM-L6-v2's WordPiece for the
encoder tasks, SmolLM2's tokenizer from its GGUF for text generation). Each pipeline's answer is checked against
the same model called directly, so the pipeline glue (pre-processing, output keys, post-processing) is what is
under test.

transformers 5.x removed the "question-answering" and "text2text-generation" pipelines (pipelines.REMOVED_TASKS);
for those tasks the tests check what replaces them: the QA head through AutoModelForQuestionAnswering with a
(question, context) pair, and seq2seq generation through tokenizer + generate + batch_decode."""

from __future__ import annotations

import pytest
import torch
from weight_packages import SMOLLM2_GGUF_NAME
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, pipeline

import hf_tiny

TEXTS = ["the cat sat on the [MASK] .", "paris is the [MASK] of france, said the tiny model."]

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def wordpiece(real_minilm_dir):
    return AutoTokenizer.from_pretrained(real_minilm_dir)


def _encoder_config(tokenizer, **labels) -> hf_tiny.TinyEncoderConfig:
    return hf_tiny.TinyEncoderConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=128, initializer_range=0.2, pad_token_id=tokenizer.pad_token_id, **labels,
    )


def _direct(model, tokenizer, text, **kwargs):
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt", **kwargs))


def test_fill_mask(wordpiece):
    torch.manual_seed(0)
    model = hf_tiny.TinyEncoderForMaskedLM(_encoder_config(wordpiece)).eval()
    fill = pipeline("fill-mask", model=model, tokenizer=wordpiece)
    for text in TEXTS:
        answers = fill(text, top_k=5)
        encoded = wordpiece(text, return_tensors="pt")
        position = (encoded["input_ids"][0] == wordpiece.mask_token_id).nonzero().item()
        probabilities = _direct(model, wordpiece, text).logits[0, position].softmax(-1)
        expected = probabilities.topk(5)
        assert [a["token"] for a in answers] == expected.indices.tolist()
        assert torch.allclose(torch.tensor([a["score"] for a in answers]), expected.values, atol=1e-6)
        for answer in answers:
            filled = encoded["input_ids"][0].clone()
            filled[position] = answer["token"]
            assert answer["sequence"] == wordpiece.decode(filled, skip_special_tokens=True)
            assert answer["token_str"] == wordpiece.decode([answer["token"]])


def test_feature_extraction(wordpiece):
    torch.manual_seed(0)
    model = hf_tiny.TinyEncoderModel(_encoder_config(wordpiece)).eval()
    extract = pipeline("feature-extraction", model=model, tokenizer=wordpiece)
    for text in ["a short one", "a somewhat longer sentence with more word pieces in it"]:
        features = torch.tensor(extract(text))
        expected = _direct(model, wordpiece, text).last_hidden_state
        assert features.shape == expected.shape
        assert (features - expected).abs().max().item() <= 1e-6


def test_text_classification(wordpiece):
    torch.manual_seed(0)
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    model = hf_tiny.TinyEncoderForSequenceClassification(_encoder_config(wordpiece, id2label=labels)).eval()
    classify = pipeline("text-classification", model=model, tokenizer=wordpiece)
    texts = ["what a lovely day", "this is terrible and slow", "ok"]
    results = classify(texts, top_k=None)
    for text, scores in zip(texts, results):
        expected = _direct(model, wordpiece, text).logits[0].softmax(-1)
        got = {entry["label"]: entry["score"] for entry in scores}
        assert set(got) == set(labels.values())
        for index, label in labels.items():
            assert abs(got[label] - expected[index].item()) <= 1e-6
    top = classify(texts[0])[0]
    assert top["label"] == labels[int(_direct(model, wordpiece, texts[0]).logits.argmax())]


def test_token_classification(wordpiece):
    torch.manual_seed(0)
    labels = {0: "O", 1: "B-LOC", 2: "I-LOC"}
    model = hf_tiny.TinyEncoderForTokenClassification(_encoder_config(wordpiece, id2label=labels)).eval()
    with torch.no_grad():  # a head large enough that the tokens do not all get the same label
        model.classifier.weight.normal_(0.0, 3.0)
    tag = pipeline("token-classification", model=model, tokenizer=wordpiece, ignore_labels=[])
    text = "the tiny model flew from paris to new york"
    entities = tag(text)
    encoded = wordpiece(text, return_offsets_mapping=True)
    probabilities = _direct(model, wordpiece, text).logits[0].softmax(-1)
    words = [i for i, t in enumerate(encoded["input_ids"]) if t not in wordpiece.all_special_ids]
    assert [e["index"] for e in entities] == words
    for entity in entities:
        index = entity["index"]
        assert entity["entity"] == labels[int(probabilities[index].argmax())]
        assert abs(entity["score"] - probabilities[index].max().item()) <= 1e-6
        start, end = encoded["offset_mapping"][index]
        assert (entity["start"], entity["end"]) == (start, end)
    assert len({e["entity"] for e in entities}) > 1  # a large init: the labels are not all the same


@pytest.mark.parametrize("task", ["question-answering", "text2text-generation"])
def test_removed_pipelines_are_reported_by_transformers(wordpiece, task):
    """If this starts failing, transformers brought the task back: test the pipeline itself then."""
    from transformers.pipelines import REMOVED_TASKS

    assert task in REMOVED_TASKS
    model = hf_tiny.TinyEncoderForQuestionAnswering(_encoder_config(wordpiece))
    with pytest.raises(KeyError, match=f"The task {task} has been removed from transformers"):
        pipeline(task, model=model, tokenizer=wordpiece)


def test_question_answering_head_through_auto_class(wordpiece, tmp_path):
    """What the removed QA pipeline did: a (question, context) pair through the QA head, the best span of the
    context by start + end logits, mapped back to characters with the tokenizer's offsets."""
    torch.manual_seed(0)
    hf_tiny.TinyEncoderForQuestionAnswering(_encoder_config(wordpiece)).save_pretrained(tmp_path / "qa")
    model = AutoModelForQuestionAnswering.from_pretrained(tmp_path / "qa").eval()
    assert isinstance(model, hf_tiny.TinyEncoderForQuestionAnswering)
    question, context = "where did the model fly?", "the tiny model flew from paris to new york last week."
    encoded = wordpiece(question, context, return_tensors="pt", return_offsets_mapping=True)
    offsets = encoded.pop("offset_mapping")[0]
    with torch.no_grad():
        output = model(**encoded)
    assert output.start_logits.shape == output.end_logits.shape == encoded["input_ids"].shape
    in_context = (encoded["token_type_ids"][0] == 1) & (encoded["input_ids"][0] != wordpiece.sep_token_id)
    start = output.start_logits[0].masked_fill(~in_context, -torch.inf)
    end = output.end_logits[0].masked_fill(~in_context, -torch.inf)
    spans = (start[:, None] + end[None, :]).triu().tril(15)  # start <= end, at most 16 tokens
    best = int(spans.flatten().argmax())
    first, last = divmod(best, spans.shape[1])
    answer = context[int(offsets[first][0]) : int(offsets[last][1])]
    assert answer and answer in context


def test_text2text_with_generate(wordpiece):
    """What the removed text2text-generation pipeline did: tokenizer -> generate -> batch_decode."""
    torch.manual_seed(0)
    config = hf_tiny.TinySeq2SeqConfig(
        vocab_size=len(wordpiece), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, initializer_range=0.2, pad_token_id=wordpiece.pad_token_id,
        bos_token_id=wordpiece.cls_token_id, eos_token_id=wordpiece.sep_token_id,
        decoder_start_token_id=wordpiece.cls_token_id,
    )
    model = hf_tiny.TinySeq2SeqForConditionalGeneration(config).eval()
    # BERT's tokenizer also returns token_type_ids, which an encoder-decoder does not take
    texts = ["translate this to something", "hi"]
    batch = wordpiece(texts, padding=True, return_tensors="pt", return_token_type_ids=False)
    generated = model.generate(**batch, max_new_tokens=6, do_sample=False)
    decoded = wordpiece.batch_decode(generated, skip_special_tokens=True)
    assert len(decoded) == 2 and all(isinstance(t, str) for t in decoded)
    # each row alone gives the same tokens as in the padded batch (padding does not leak into the answer)
    for row, text in enumerate(texts):
        single = wordpiece(text, return_tensors="pt", return_token_type_ids=False)
        alone = model.generate(**single, max_new_tokens=6, do_sample=False)
        width = alone.shape[1]
        assert torch.equal(alone[0], generated[row, :width]), row
    # the first generated token is the argmax of one forward pass from the decoder start token
    with torch.no_grad():
        start = torch.full((2, 1), config.decoder_start_token_id)
        first = model(**batch, decoder_input_ids=start).logits[:, -1].argmax(-1)
    assert torch.equal(generated[:, 1], first)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf):
    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=SMOLLM2_GGUF_NAME)


@pytest.mark.slow
@pytest.mark.real_weights
def test_text_generation(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    torch.manual_seed(0)
    config = hf_tiny.TinyCausalConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = hf_tiny.TinyCausalForCausalLM(config).eval()
    generate = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompts = ["Once upon a time", "The capital of France is a city that"]
    outputs = generate(prompts, max_new_tokens=8, do_sample=False, batch_size=2)
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer(prompt, return_tensors="pt")
        expected = model.generate(**ids, max_new_tokens=8, do_sample=False)
        expected_text = tokenizer.decode(expected[0], skip_special_tokens=True)
        assert output[0]["generated_text"] == expected_text
        assert output[0]["generated_text"].startswith(prompt)
    # chat input: SmolLM2-Instruct's chat template from the GGUF, the answer comes back as an assistant turn
    chat = generate([{"role": "user", "content": "Say hi"}], max_new_tokens=4, do_sample=False)
    turns = chat[0]["generated_text"]
    assert [t["role"] for t in turns] == ["user", "assistant"]
    assert isinstance(turns[-1]["content"], str)


def test_a_freshly_initialized_head_is_reported_when_loading(tmp_path):
    """fill-mask on a folder holding only the encoder body: the MLM head is new, random, and transformers' load
    report must say so (a warning naming the missing lm_head tensors), as for official BERT."""
    import logging

    from transformers import AutoModelForMaskedLM

    from hf_tiny import TinyEncoderConfig, TinyEncoderModel

    config = TinyEncoderConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=24, max_position_embeddings=16)
    TinyEncoderModel(config).save_pretrained(tmp_path / "body")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        _, info = AutoModelForMaskedLM.from_pretrained(tmp_path / "body", output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    assert {"lm_head.dense.weight", "lm_head.decoder.bias"} <= set(info["missing_keys"])
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert any("lm_head.dense.weight" in w and "MISSING" in w for w in warnings), warnings

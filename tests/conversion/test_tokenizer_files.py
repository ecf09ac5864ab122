"""The text side of a converted folder loads as official loads the source's: the tokenizer class AutoTokenizer
picks (from config.json's model_type where tokenizer_config.json names none, or in place of the one it names for
some model types: the converted folder's model_type is hf_tiny's), the named chat templates, a remote-code
tokenizer's module, and a seq2seq source's generation_config.json as it is. Official AutoTokenizer /
from_pretrained on the source is the reference; tokenizers are trained in-process (nothing downloads)."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedTokenizerFast, pipeline

import hf_tiny  # noqa: F401
from bert_models import official_model
from causal_helpers import tiny_official
from conversion import bert, llama, t5
from t5_models import make_official_t5

CORPUS = ["Hello world, héllo wörld! 🤗", "The quick brown fox jumps over the lazy dog.", "naïve café résumé"] * 20
TEXTS = ["Hello world", "  two  spaces ", "héllo 🤗", "", "[MASK] and [SEP] here", "<s> inside </s>"]
BERT_WORDS = "the quick brown fox jumps over lazy dog hello world ! , . a b c d e".split()


def tokens_of(tokenizer) -> dict:
    """What a user of the tokenizer sees: its class, special tokens, and the ids of a few texts and a padded pair."""
    specials = {name: getattr(tokenizer, name) for name in
                ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")}
    padded = tokenizer(["a", "the quick fox"], padding=True) if tokenizer.pad_token is not None else None
    return {"class": type(tokenizer).__name__, **specials, "ids": [tokenizer(t)["input_ids"] for t in TEXTS],
            "padded": None if padded is None else dict(padded)}


def bert_source(folder):
    """A BertForMaskedLM folder laid out as bert-base-uncased: vocab.txt, tokenizer.json, and a tokenizer_config.json
    without tokenizer_class."""
    from transformers import BertTokenizer

    official_model("BertForMaskedLM").save_pretrained(folder)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *BERT_WORDS]
    vocab += [f"w{i}" for i in range(97 - len(vocab))]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(vocab_file=str(folder / "vocab.txt")).backend_tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "model_max_length": 512}))
    return folder


def test_a_tokenizer_config_without_a_class_loads_the_class_official_picks_by_model_type(tmp_path):
    source = bert_source(tmp_path / "src")
    bert.convert(source, tmp_path / "ours")
    official = AutoTokenizer.from_pretrained(source)
    assert tokens_of(AutoTokenizer.from_pretrained(tmp_path / "ours")) == tokens_of(official)
    assert official.mask_token == "[MASK]"
    fill = pipeline("fill-mask", model=str(tmp_path / "ours"))
    official_fill = pipeline("fill-mask", model=str(source))
    assert fill("hello [MASK] world")[0]["token"] == official_fill("hello [MASK] world")[0]["token"]
    # negative control: without the class the converter names, AutoTokenizer reads hf_tiny's model_type
    config = json.loads((tmp_path / "ours" / "tokenizer_config.json").read_text())
    assert config.pop("tokenizer_class") == type(official).__name__
    (tmp_path / "ours" / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(tmp_path / "ours").mask_token is None


def metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style byte-fallback BPE (Metaspace by normalizer, as Mistral's and Phi-3's tokenizer.json)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tokenizer.train_from_iterator([text.replace(" ", "▁") for text in CORPUS], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens]))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 1)])
    return tokenizer


def test_a_class_official_replaces_for_the_model_type_is_replaced_in_the_converted_folder_too(tmp_path):
    """Mistral folders on the Hub name LlamaTokenizer, which official ignores for model_type mistral (with this
    tokenizer.json its ids differ from LlamaTokenizer's on runs of spaces and on special tokens inside text); the
    converted folder must load what official loads. Negative control: the class the source names, as converters
    copied it before, gives other ids."""
    tokenizer = metaspace_tokenizer()
    source = tmp_path / "src"
    tiny_official("mistral", vocab_size=tokenizer.get_vocab_size(), pad_token_id=None, bos_token_id=1,
                  eos_token_id=2).save_pretrained(source)
    tokenizer.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "legacy": False}))
    llama.convert(source, tmp_path / "ours")
    official = AutoTokenizer.from_pretrained(source)
    assert type(official).__name__ != "LlamaTokenizer"  # else this test checks nothing
    assert tokens_of(AutoTokenizer.from_pretrained(tmp_path / "ours")) == tokens_of(official)
    config = json.loads((tmp_path / "ours" / "tokenizer_config.json").read_text())
    (tmp_path / "ours" / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert tokens_of(AutoTokenizer.from_pretrained(tmp_path / "ours"))["ids"] != tokens_of(official)["ids"]


def byte_level_tokenizer(specials) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL_CHAT = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
             "<|im_end|>\n{% endif %}") + CHAT


@pytest.mark.parametrize("direction", ["converted", "converted back"])
def test_named_chat_templates_travel_both_ways(direction, tmp_path):
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]), eos_token="<|im_end|>",
        pad_token="<|endoftext|>", chat_template={"default": CHAT, "tool_use": TOOL_CHAT})
    source = tmp_path / "src"
    official_model = tiny_official("qwen2", vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=None, eos_token_id=2)
    official_model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    assert (source / "additional_chat_templates" / "tool_use.jinja").is_file()
    llama.convert(source, tmp_path / "ours")
    folder = tmp_path / "ours"
    if direction == "converted back":
        llama.convert_back(tmp_path / "ours", tmp_path / "back")
        folder = tmp_path / "back"
    official, ours = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "hello world"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "", "parameters": {}}}]
    for options in ({}, {"tools": tools}, {"chat_template": "tool_use"}):
        expected = official.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options)
        assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options) == expected
    assert "get_weather" in official.apply_chat_template(messages, tools=tools, tokenize=False)


def test_a_remote_code_tokenizer_travels_with_its_module(tmp_path):
    source = tmp_path / "src"
    tokenizer = byte_level_tokenizer(["<pad>", "<s>", "</s>"])
    tiny_official("llama", vocab_size=tokenizer.get_vocab_size()).save_pretrained(source)
    tokenizer.save(str(source / "tokenizer.json"))
    (source / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass CustomTokenizer(PreTrainedTokenizerFast):\n"
        "    def custom(self):\n        return 42\n")
    (source / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "CustomTokenizer", "auto_map": {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]},
        "eos_token": "</s>", "pad_token": "<pad>"}))
    llama.convert(source, tmp_path / "ours")  # no prompt: parity reads the tokenizer without remote code
    ours = AutoTokenizer.from_pretrained(tmp_path / "ours", trust_remote_code=True)
    assert type(ours).__name__ == "CustomTokenizer" and ours.custom() == 42
    official = AutoTokenizer.from_pretrained(source, trust_remote_code=True)
    assert ours("Hello world")["input_ids"] == official("Hello world")["input_ids"]


def test_a_seq2seq_generation_config_is_kept_as_official_generates_with_it(tmp_path):
    """A T5 generation_config.json without pad_token_id: official pads finished rows with eos (its generate's
    fallback); the converted folder must not fill in config.json's pad id."""
    source = make_official_t5(tmp_path / "src", vocab_size=64, pad_token_id=0, eos_token_id=1)
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8, 1], [9, 10, 1, 0, 0]]),
              "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}
    official = AutoModelForSeq2SeqLM.from_pretrained(source).eval()
    free = official.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None)
    stop = int(free[0, 2])  # a token row 0 emits early and row 1 does not: row 0 finishes first
    assert stop not in free[1, 1:3].tolist()
    text = json.dumps({"decoder_start_token_id": 0, "eos_token_id": stop})
    (source / "generation_config.json").write_text(text)
    t5.convert(source, tmp_path / "ours")
    assert (tmp_path / "ours" / "generation_config.json").read_text() == text
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours").eval()
    expected = AutoModelForSeq2SeqLM.from_pretrained(source).eval().generate(**inputs, max_new_tokens=8, do_sample=False)
    assert stop in expected[0, 1:].tolist() and expected[0, -1] == stop  # finished rows padded with eos, not 0
    assert torch.equal(ours.generate(**inputs, max_new_tokens=8, do_sample=False), expected)

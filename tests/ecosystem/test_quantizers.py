"""Quantizers (issue 33 item 1): every quantizer transformers ships that runs on a CPU (bitsandbytes 4 and 8 bit,
torchao int8 weight-only, optimum-quanto int8, SINQ 4-bit where installed) replaces in hf_tiny models exactly the modules it replaces in the
official model on the same weights (hf_tiny's projections are plain nn.Linear), and the quantized outputs are as
close to the official quantized model's as two loads of the official one are. The runtime's few-row decode product
stays on the plain nn.Linear modules only. HQQ is not in this list: transformers 5.24 refuses HqqConfig itself
("not available yet")."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, BitsAndBytesConfig, QuantoConfig, SinqConfig, TorchAoConfig

import hf_tiny  # noqa: F401  (registers the Auto classes)
from causal_helpers import max_diff, tiny_official
from conversion import bert, llama
from bert_models import official_model, padded_batch

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _torchao_int8():
    from torchao.quantization import Int8WeightOnlyConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


# name -> (package, config factory); quanto's int4 is left out: its CPU kernel build takes minutes
QUANTIZERS = {
    "bnb_4bit": ("bitsandbytes", lambda: BitsAndBytesConfig(load_in_4bit=True)),
    "bnb_8bit": ("bitsandbytes", lambda: BitsAndBytesConfig(load_in_8bit=True)),
    "torchao_int8_weight_only": ("torchao", _torchao_int8),
    "quanto_int8": ("optimum.quanto", lambda: QuantoConfig(weights="int8")),
    # SINQ quantizing the LM head fails on the official model too ("SinqQuantize on tensors destined for lm_head")
    "sinq_4bit": ("sinq", lambda: SinqConfig(modules_to_not_convert=["lm_head"])),
}
# bitsandbytes' 4-bit CPU kernel packs blocks of 64 input features: hidden sizes are multiples of 64
SIZES = {"causal": dict(hidden_size=64, intermediate_size=128), "encoder": dict(hidden=64, intermediate=128)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """{"causal" | "encoder": (official folder, converted folder)}: tiny official Llama and BERT, converted."""
    root = tmp_path_factory.mktemp("quantizers")
    pairs = {"causal": (tiny_official("llama", **SIZES["causal"]), llama),
             "encoder": (official_model("BertModel", **SIZES["encoder"]), bert)}
    out = {}
    for family, (official, converter) in pairs.items():
        official.save_pretrained(root / family)
        converter.convert(root / family, root / f"{family}_ours")
        out[family] = (root / family, root / f"{family}_ours")
    return out


def load(family: str, folder, quantizer: str):
    package, config = QUANTIZERS[quantizer]
    if importlib.util.find_spec(package.split(".")[0]) is None:
        why = {"sinq": " (not pinned: importing it patches transformers)",
               "torchao": " (not pinned: with CPU torch it logs 'Failed to load' at every transformers model load)"}
        pytest.skip(f"{package} is not installed{why.get(package.split('.')[0], ' (the test extra pins it)')}")
    auto = AutoModelForCausalLM if family == "causal" else AutoModel
    return auto.from_pretrained(folder, quantization_config=config(), device_map="cpu").eval()


def quantized_modules(model) -> set[str]:
    """Modules a quantizer replaced (bitsandbytes', quanto's, SINQ's classes) or whose weight it replaced (torchao)."""
    names = set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        weight_class = type(weight.data if isinstance(weight, torch.nn.Parameter) else weight)
        if type(module).__module__.startswith(("bitsandbytes", "optimum", "sinq")) or weight_class.__module__.startswith("torchao"):
            names.add(name)
    return names


def as_ours(family: str, name: str) -> str:
    """An official module name under hf_tiny's names (conversion.bert's layer map for BERT; Llama's are ours)."""
    if family == "causal":
        return name
    layer = re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)", name)
    return f"layers.{layer[1]}.{bert.LAYER_MODULES[layer[2]]}" if layer else name


def outputs(family: str, model) -> torch.Tensor:
    with torch.no_grad():
        if family == "causal":
            ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
            return model(ids).logits
        batch = padded_batch()
        return model(**batch).last_hidden_state[batch["attention_mask"].bool()]


@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
@pytest.mark.parametrize("family", ["causal", "encoder"])
def test_quantizer_replaces_the_official_modules_and_matches_official_outputs(folders, family, quantizer):
    official_folder, ours_folder = folders[family]
    official, again, ours = (load(family, folder, quantizer) for folder in (official_folder, official_folder, ours_folder))
    replaced = quantized_modules(ours)
    assert replaced and replaced == {as_ours(family, name) for name in quantized_modules(official)}
    bound = max_diff(outputs(family, official), outputs(family, again))  # 0.0 for all four on this machine
    expected = outputs(family, official)
    assert max_diff(outputs(family, ours), expected) <= bound
    # negative control: a 1e-3 change of one (unquantized) norm weight shows in the same comparison
    norm = ours.model.norm if family == "causal" else ours.embed_norm
    with torch.no_grad():
        norm.weight.mul_(1.001)
    assert max_diff(outputs(family, ours), expected) > bound + 1e-5


@pytest.mark.parametrize("quantizer", ["bnb_4bit", "bnb_8bit"])
def test_the_few_row_product_takes_plain_weights_only_never_quantized_ones(folders, quantizer, monkeypatch):
    """Decoding's weight-first products (runtime.WeightFirstProducts, on every weight here) replace F.linear on plain
    fp32 weights only: the quantized modules compute with their own kernels; greedy tokens equal official's and are
    the same with the runtime off."""
    from hf_tiny import runtime

    official_folder, ours_folder = folders["causal"]
    official, ours = load("causal", official_folder, quantizer), load("causal", ours_folder, quantizer)
    monkeypatch.setattr(runtime, "MIN_WEIGHT_ELEMENTS", 1)
    monkeypatch.setattr(runtime, "MIN_SLICE", 8)
    taken = []
    original = runtime.few_rows_linear
    monkeypatch.setattr(runtime, "few_rows_linear", lambda x, weight, *rest: taken.append(weight) or original(x, weight, *rest))
    quantized = {id(p) for name in quantized_modules(ours) for p in ours.get_submodule(name).parameters()}
    assert quantized and not any("forward" in vars(module) for module in ours.modules())
    prompt = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = official.generate(prompt, **settings)
        assert torch.equal(ours.generate(prompt, **settings), expected)
        assert taken and all(id(weight) not in quantized and weight.dtype is torch.float32 for weight in taken)
        with hf_tiny.runtime.disabled():
            assert torch.equal(ours.generate(prompt, **settings), expected)


# Where official leaves weights unquantized that hf_tiny holds as plain nn.Linear (MoE experts, 3-D parameters in
# official 5.24), docs/compatibility.md gives the skip list that quantizes as official does. These are those lists.
# (T5's `wo`, which official keeps by _keep_in_fp32_modules, hf_tiny keeps alike: no list, test below.)
SKIP_AS_OFFICIAL = {"mixtral": [r".*\.experts\..*", "lm_head"]}


def _t5_pair(root):
    from transformers import T5Config, T5ForConditionalGeneration

    from conversion import t5

    torch.manual_seed(0)
    official = T5ForConditionalGeneration(T5Config(
        vocab_size=97, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, feed_forward_proj="gated-gelu", tie_word_embeddings=False))
    official.save_pretrained(root / "t5")
    t5.convert(root / "t5", root / "t5_ours")
    return root / "t5", root / "t5_ours"


@pytest.mark.parametrize("family", sorted(SKIP_AS_OFFICIAL))
def test_the_documented_skip_list_quantizes_as_official(family, tmp_path):
    """With the skip list of docs/compatibility.md, bitsandbytes 8-bit replaces the official model's modules and the
    outputs are equal; negative control: without it, hf_tiny quantizes more (every expert) and the outputs differ."""
    pytest.importorskip("bitsandbytes")
    tiny_official("mixtral", hidden_size=64, intermediate_size=128).save_pretrained(tmp_path / "mixtral")
    llama.convert(tmp_path / "mixtral", tmp_path / "mixtral_ours")
    official_folder, ours_folder = tmp_path / "mixtral", tmp_path / "mixtral_ours"
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))

    def quantized(folder, skip=None):
        return _quantized_8bit(AutoModelForCausalLM, folder, {"input_ids": ids}, skip)[:2]

    official_count, official_logits = quantized(official_folder)
    count, logits = quantized(ours_folder, SKIP_AS_OFFICIAL[family])
    assert count == official_count and max_diff(logits, official_logits) == 0.0
    default_count, default_logits = quantized(ours_folder)
    assert default_count > official_count and max_diff(default_logits, official_logits) > 1e-4


def _quantized_8bit(auto, folder, inputs, skip=None):
    """(how many modules bitsandbytes 8-bit replaced, the logits of `inputs`) for a folder loaded through `auto`."""
    config = BitsAndBytesConfig(load_in_8bit=True, **({"llm_int8_skip_modules": skip} if skip else {}))
    model = auto.from_pretrained(folder, quantization_config=config, device_map="cpu").eval()
    with torch.no_grad():
        return len(quantized_modules(model)), model(**inputs).logits, model


def test_t5_quantizes_as_official_leaving_its_feed_forward_output_projections(tmp_path):
    """Official T5 keeps `wo` out of bitsandbytes (_keep_in_fp32_modules); hf_tiny's T5 layout keeps down_proj
    alike, with no skip list: the same modules replaced, equal outputs, every down_proj still an unquantized Linear."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForSeq2SeqLM

    official_folder, ours_folder = _t5_pair(tmp_path)
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    official_count, official_logits, _ = _quantized_8bit(AutoModelForSeq2SeqLM, official_folder, inputs)
    count, logits, ours = _quantized_8bit(AutoModelForSeq2SeqLM, ours_folder, inputs)
    assert count == official_count and max_diff(logits, official_logits) == 0.0
    down = [name for name, _ in ours.named_modules() if name.endswith("down_proj")]
    assert down and not set(down) & quantized_modules(ours)


def test_pytorchs_dynamic_quantization_replaces_t5s_modules_as_officials(tmp_path):
    """torch.ao picks the modules it quantizes by their exact type: every projection of hf_tiny's T5 (down_proj
    included, whose input T5's feed-forward casts itself) is a plain nn.Linear, so quantize_dynamic replaces the
    modules it replaces in official T5 (wo included) and the outputs are equal."""
    from torch import nn
    from transformers import AutoModelForSeq2SeqLM

    official_folder, ours_folder = _t5_pair(tmp_path)
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    results = []
    for folder in (official_folder, ours_folder):
        model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
        linears = sum(type(module) is nn.Linear for module in model.modules())
        quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
        left = [name for name, module in quantized.named_modules() if type(module) is nn.Linear]
        with torch.no_grad():
            results.append((linears, left, quantized(**inputs).logits))
    (official_linears, official_left, official_logits), (linears, left, logits) = results
    assert linears == official_linears and left == official_left == []
    assert max_diff(logits, official_logits) == 0.0


HEAD_SKIPS = {"roberta": "RobertaForSequenceClassification", "distilbert": "DistilBertForSequenceClassification",
              "electra": "ElectraForSequenceClassification"}


@pytest.mark.parametrize("family", sorted(HEAD_SKIPS))
def test_a_classifier_heads_skip_list_quantizes_as_official_with_pre_classifier_named(family, tmp_path):
    """Official's head (RoBERTa's and ELECTRA's classifier.dense, DistilBERT's pre_classifier) stays unquantized with
    llm_int8_skip_modules=["classifier"]; hf_tiny's dense layer before the classifier is `pre_classifier.dense`,
    which the list must name too (docs/compatibility.md): then the same modules are replaced and the outputs equal.
    Negative control: with official's list alone hf_tiny quantizes that layer and the outputs differ."""
    pytest.importorskip("bitsandbytes")
    import importlib

    import encoder_checkpoint_models
    from transformers import AutoModelForSequenceClassification

    make = getattr(encoder_checkpoint_models, f"official_{family}")
    sizes = dict(hidden=64, intermediate=128, num_labels=3, **({"embedding": 64} if family == "electra" else {}))
    make(HEAD_SKIPS[family], **sizes).save_pretrained(tmp_path / "official")
    importlib.import_module(f"conversion.{family}").convert(tmp_path / "official", tmp_path / "ours")
    inputs = {"input_ids": torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))}

    def quantized(folder, skip):
        return _quantized_8bit(AutoModelForSequenceClassification, folder, inputs, skip)[:2]

    official_count, official_logits = quantized(tmp_path / "official", ["classifier"])
    count, logits = quantized(tmp_path / "ours", ["classifier", "pre_classifier"])
    assert count == official_count and max_diff(logits, official_logits) == 0.0
    short_count, short_logits = quantized(tmp_path / "ours", ["classifier"])
    assert short_count == official_count + 1 and max_diff(short_logits, official_logits) > 1e-4

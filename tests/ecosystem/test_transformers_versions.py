"""The supported transformers and torch ranges and the cache's two names (hf_tiny/transformers_api.py).

transformers 5.24 renamed the cache argument `past_key_values` -> `cache`: a model that read only the old name ran
every decoding step without its cache and generated garbage without an error. These tests pin the range in one
place, both names on every head, and the once-per-class check that stops generation outside the tested range when
cached decoding disagrees with uncached decoding.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from transformers import DynamicCache

import hf_tiny.transformers_api as api
from hf_tiny import step as step_prep
from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM, TinySeq2SeqConfig, TinySeq2SeqForConditionalGeneration

ROOT = Path(__file__).resolve().parents[2]
CAUSAL = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
IDS = torch.tensor([[5, 9, 14, 3, 22, 7], [8, 1, 30, 2, 11, 4]])


def causal_model():
    torch.manual_seed(0)
    return TinyCausalForCausalLM(TinyCausalConfig(**CAUSAL, initializer_range=0.5)).eval()


def seq2seq_model():
    torch.manual_seed(0)
    config = TinySeq2SeqConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, pad_token_id=0, decoder_start_token_id=1, eos_token_id=2, initializer_range=0.5,
    )
    return TinySeq2SeqForConditionalGeneration(config).eval()


def test_pyproject_readme_and_code_state_one_range():
    oldest, newest = api.TESTED_TRANSFORMERS
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'"transformers>={re.escape(oldest)},<={re.escape(newest)}"', pyproject)
    assert f"transformers>={oldest},<={newest}" in (ROOT / "README.md").read_text()
    assert api.tested_range_text() == f">={oldest},<={newest}"
    assert api.in_tested_range(), f"the suite runs with transformers {transformers.__version__}, outside the range"


@pytest.mark.parametrize(
    "version, inside", [("5.16.1", True), ("5.20.0", True), ("5.24.0", True), ("5.16.0", False),
                        ("5.24.1", False), ("5.25.0.dev0", False), ("4.57.1", False)],
)
def test_tested_range_boundaries(version, inside):
    assert api.in_tested_range(version) is inside


@torch.no_grad()
def test_cache_and_past_key_values_name_one_argument():
    model = causal_model()
    prompt, step = IDS[:, :5], IDS[:, 5:]
    logits = {}
    for name in ("cache", "past_key_values"):
        cache = DynamicCache(config=model.config)
        model(prompt, **{name: cache}, use_cache=True)
        out = model(step, **{name: cache}, use_cache=True)
        assert step_prep.cache_of(out) is cache
        assert cache.get_seq_length() == 6
        logits[name] = out.logits
    full = model(IDS, use_cache=False).logits[:, -1:]
    torch.testing.assert_close(logits["cache"], full, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits["cache"], logits["past_key_values"])
    with pytest.raises(ValueError, match="cache= .* or past_key_values= .* not both"):
        model(step, cache=DynamicCache(), past_key_values=DynamicCache())
    with pytest.raises(TypeError, match="cache must be a transformers Cache"):
        model(step, cache=((torch.zeros(1),),))


def test_outputs_declare_the_installed_cache_field():
    model = causal_model()
    out = model(IDS, use_cache=True)
    assert step_prep.CACHE_FIELD in out.keys()
    assert isinstance(out[step_prep.CACHE_FIELD], DynamicCache)


@pytest.fixture
def untested_transformers(monkeypatch):
    """transformers as if it lay outside the tested range, with the once-per-process memory reset."""
    monkeypatch.setattr(api, "TESTED_TRANSFORMERS", ("0.0.1", "0.0.2"))
    monkeypatch.setattr(api, "_warned_untested", set())
    monkeypatch.setattr(api, "_checked_classes", {})


@pytest.mark.parametrize("build", [causal_model, seq2seq_model], ids=["causal", "seq2seq"])
def test_outside_the_range_warns_once_and_a_working_model_generates(untested_transformers, build):
    model = build()
    with pytest.warns(UserWarning, match=rf"tested with transformers >=0\.0\.1,<=0\.0\.2; transformers "
                                         rf"{re.escape(transformers.__version__)} is installed"):
        first = model.generate(IDS[:, :4], max_new_tokens=3, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning and the check happen once
        second = model.generate(IDS[:, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(first, second)
    assert api._checked_classes == {type(model): None}


def _drop_the_cache(prepare):
    """What transformers 5.24's renamed cache argument did to hf_tiny: every decoding step ran on the new token alone,
    without the cache, and without an error."""

    def prepare_without_cache(input_ids, **kwargs):
        inputs = prepare(input_ids, **kwargs)
        for name in ("cache", "past_key_values"):
            if isinstance(inputs.get(name), DynamicCache) and inputs[name].get_seq_length():
                inputs[name] = None
                inputs.pop("attention_mask", None)
                inputs.pop("position_ids", None)
        return inputs

    return prepare_without_cache


def test_outside_the_range_a_broken_cache_stops_generation(untested_transformers):
    model = causal_model()
    model.prepare_inputs_for_generation = _drop_the_cache(model.prepare_inputs_for_generation)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError) as info:
        model.generate(IDS[:, :4], max_new_tokens=3, do_sample=False)
    message = str(info.value)
    assert "cached generation does not match uncached generation (relative logit difference" in message
    assert transformers.__version__ in message and ">=0.0.1,<=0.0.2" in message
    with pytest.raises(RuntimeError, match="cached generation does not match"):  # remembered for the class
        model.generate(IDS[:, :4], max_new_tokens=3, do_sample=False)


def test_outside_the_range_a_failing_generation_is_named(untested_transformers, monkeypatch):
    model = seq2seq_model()

    def broken_forward(*args, **kwargs):
        raise KeyError("decoder_input_ids")

    monkeypatch.setattr(model, "forward", broken_forward)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="a two-token greedy generation fails "
                                                                      r"\(KeyError: 'decoder_input_ids'\)"):
        model.generate(IDS[:, :4], max_new_tokens=3, do_sample=False)


def test_inside_the_range_nothing_is_checked(monkeypatch):
    model = causal_model()
    monkeypatch.setattr(api, "_checked_classes", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(IDS[:, :4], max_new_tokens=2, do_sample=False)
    assert api._checked_classes == {}


# ---- torch -----------------------------------------------------------------------------------------------------------

TORCH_WARNING = "hf_tiny was tested with torch"


def test_pyproject_code_and_card_state_one_torch_range():
    oldest, newest = api.TESTED_TORCH
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'"torch>={re.escape(oldest)},<={re.escape(newest)}"', pyproject)
    assert api.tested_torch_text() == f">={oldest},<={newest}"
    assert api.torch_in_tested_range(), f"the suite runs with torch {torch.__version__}, outside the range"
    from conversion import render_model_card

    card = render_model_card(
        model_name="m", model_id="me/m", base_model="b/m", source_name="b/m", pipeline_tag="text-generation", family="llama",
        auto_class="AutoModelForCausalLM", description="d.",
        parity_rows=[("eager", "float32", "cpu", 1e-6, 1e-4)],
    )
    assert f"`torch>={oldest},<={newest}`" in card and f"`transformers{api.tested_range_text()}`" in card


@pytest.mark.parametrize(
    "version, inside", [("2.10.0", True), ("2.13.0+cpu", True), ("2.15.0+cu132", True), ("2.9.1", False),
                        ("2.15.1", False), ("2.16.0.dev20261101", False), ("2.5.1", False)],
)
def test_torch_tested_range_boundaries(version, inside):
    assert api.torch_in_tested_range(version) is inside


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The once-per-process memory of both warnings reset for one test."""
    monkeypatch.setattr(api, "_warned_untested", set())


def test_outside_the_torch_range_building_a_model_warns_once(fresh_warnings, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.16.0")
    with pytest.warns(UserWarning) as recorded:
        causal_model()
    messages = [str(w.message) for w in recorded if TORCH_WARNING in str(w.message)]
    assert messages == [
        f"hf_tiny was tested with torch {api.tested_torch_text()}; torch 2.16.0 is installed. If a result looks "
        f"wrong, install a tested version (pip install 'torch{api.tested_torch_text()}')"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, whichever model comes next
        seq2seq_model()
        causal_model()


def test_inside_the_torch_range_building_a_model_does_not_warn(fresh_warnings, monkeypatch):
    for version in api.TESTED_TORCH:
        monkeypatch.setattr(torch, "__version__", f"{version}+cu130")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            causal_model()
            seq2seq_model()
    assert api._warned_untested == set()


def test_the_torch_and_transformers_warnings_are_separate(fresh_warnings, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    monkeypatch.setattr(api, "TESTED_TRANSFORMERS", ("0.0.1", "0.0.2"))
    with pytest.warns(UserWarning, match=rf"tested with torch {re.escape(api.tested_torch_text())}; torch 2\.5\.1"):
        assert api.warn_if_torch_untested()
    with pytest.warns(UserWarning, match=r"tested with transformers >=0\.0\.1,<=0\.0\.2"):
        assert api.warn_if_untested()
    assert api._warned_untested == {"torch", "transformers"}


def test_every_test_the_version_ends_run_exists():
    """CI's runs at the ends of the ranges (tests/helpers/version_ends.py) name test files and tests by path: a
    renamed one would otherwise drop out of them (pytest stops on a missing path, after the venv is built)."""
    import version_ends

    for end in version_ends.ENDS.values():
        for entry in end.tests:
            path, _, name = entry.partition("::")
            assert (ROOT / path).is_file(), f"{entry} (version_ends.ENDS)"
            if name:
                assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), entry
    assert version_ends.ENDS["torch-oldest"].version == api.TESTED_TORCH[0]
    assert version_ends.ENDS["torch-newest"].version == api.TESTED_TORCH[1]
    assert version_ends.ENDS["transformers-oldest"].version == api.TESTED_TRANSFORMERS[0]

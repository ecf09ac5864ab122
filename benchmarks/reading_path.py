"""What a reader follows: the functions of hf_tiny/ one forward (or one training step) runs through, as a tracer
records them, with their files and their lengths in lines.

    python -m benchmarks.reading_path [--runtime on|off] [--step forward|train] [--list]

The model is a small Llama-shaped hf_tiny causal LM in eval mode (train mode for --step train) on a left-padded
batch with the sdpa backend; every function of hf_tiny/ that executes is counted once, with the number of lines
of its definition. Python's own machinery and other packages' functions are not counted.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch



def _model(train: bool):
    from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM

    config = TinyCausalConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = TinyCausalForCausalLM(config)
    return model.train() if train else model.eval()


def traced_functions(step: str = "forward", runtime: bool = True) -> dict:
    """{(file, qualified name): line count} of the hf_tiny functions one call runs through."""
    model = _model(train=step == "train")
    if hasattr(model, "set_runtime"):  # hf_tiny before the runtime layer had none
        model.set_runtime(runtime)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    import hf_tiny

    package = Path(hf_tiny.__file__).resolve().parent
    seen: dict = {}

    def tracer(frame, event, arg):
        code = frame.f_code
        if event == "call" and Path(code.co_filename).resolve().parent == package:
            # A nested definition (a comprehension, a closure such as the runtime's dispatchers) is read as part of
            # the top-level definition around it, which is counted once whole.
            name = code.co_qualname.split(".<locals>")[0]
            key = (Path(code.co_filename).name, name)
            if key not in seen:
                seen[key] = _definition_lines(frame.f_globals, name, code)
        return None

    sys.setprofile(None)
    sys.settrace(tracer)
    try:
        if step == "train":
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        else:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
    finally:
        sys.settrace(None)
    return seen


def _definition_lines(module_globals: dict, qualname: str, code) -> int:
    """The line count of the module-level definition `qualname` (a function, or a class's method), else of `code`."""
    target = module_globals.get(qualname.split(".")[0])
    for part in qualname.split(".")[1:]:
        target = getattr(target, part, None)
    target = inspect.unwrap(target) if callable(target) else None
    try:
        return len(inspect.getsourcelines(target if target is not None else code)[0])
    except (OSError, TypeError):
        return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step", choices=("forward", "train"), default="forward")
    parser.add_argument("--runtime", choices=("on", "off"), default="on")
    parser.add_argument("--list", action="store_true", help="list every function with its length")
    args = parser.parse_args(argv)
    seen = traced_functions(args.step, args.runtime == "on")
    files = sorted({name for name, _ in seen})
    print(f"{args.step} (runtime {args.runtime}): {len(seen)} functions, {sum(seen.values())} lines, "
          f"{len(files)} files: {', '.join(files)}")
    if args.list:
        for (file, name), lines in sorted(seen.items()):
            print(f"  {lines:4d}  {file}:{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

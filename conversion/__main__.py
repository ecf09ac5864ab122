"""`python -m conversion FAMILY SRC DST [--reverse] [--force] [--debug] [--dtype float32|bfloat16|float16]`

Forward: an official Hugging Face checkpoint (SRC) -> an hf_tiny checkpoint (DST).
--reverse: an hf_tiny checkpoint -> the official format (not every family has one).
A failure prints one line `error: ...` on stderr and exits with 1 (2 for usage errors); --debug shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys

# family name -> module exposing convert(src, dst, *, force=False, dtype=None) [and convert_back(src, dst, *, force)]
FAMILIES = {
    "bert": "conversion.bert",
    "llama": "conversion.llama",
    "bart": "conversion.bart",
    "t5": "conversion.t5",
    "bert2seq": "conversion.bert2seq",
}

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad command line: exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message and exits; we want one line and exit 2
        raise UsageError(f"{message} (see python -m conversion --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m conversion",
        description="Convert checkpoints between official Hugging Face formats and hf_tiny.",
    )
    parser.add_argument("family", help=f"model family: {', '.join(FAMILIES)}")
    parser.add_argument("src", help="source checkpoint folder (or file, e.g. a .gguf for llama)")
    parser.add_argument("dst", help="destination folder (written atomically)")
    parser.add_argument(
        "--reverse", action="store_true", help="convert an hf_tiny checkpoint back to the official format"
    )
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating weights")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on failure")
    return parser


def _load_family(family: str):
    from .core import ConversionError

    if family not in FAMILIES:
        raise UsageError(f"unknown family {family!r}; known families: {', '.join(FAMILIES)}")
    module_name = FAMILIES[family]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            raise ConversionError(
                f"family {family!r} is registered but its converter module {module_name} is not available"
            ) from error
        raise


def run(args: argparse.Namespace) -> None:
    from .core import ConversionError, parse_dtype

    module = _load_family(args.family)
    if args.reverse:
        if args.dtype is not None:
            raise UsageError("--dtype applies only to the forward direction, not with --reverse")
        convert_back = getattr(module, "convert_back", None)
        if convert_back is None:
            raise UsageError(f"family {args.family!r} has no reverse conversion (--reverse)")
        convert_back(args.src, args.dst, force=args.force)
    else:
        convert = getattr(module, "convert", None)
        if convert is None:
            raise ConversionError(f"converter module {FAMILIES[args.family]} defines no convert() function")
        kwargs = {"force": args.force}
        if args.dtype is not None:
            if "dtype" not in inspect.signature(convert).parameters:
                raise UsageError(f"family {args.family!r} does not support --dtype")
            kwargs["dtype"] = parse_dtype(args.dtype)
        convert(args.src, args.dst, **kwargs)


def _one_line(error: BaseException) -> str:
    from .core import ConversionError

    text = " ".join(str(error).split()) or "(no message)"
    if isinstance(error, (ConversionError, UsageError, ValueError, TypeError, FileNotFoundError, RuntimeError)):
        return text
    return f"{type(error).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        run(args)
    except UsageError as error:
        if debug:
            raise
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted; the destination was left as it was", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:
        if debug:
            raise
        hint = "" if _is_expected(error) else " (run with --debug for the traceback)"
        print(f"error: {_one_line(error)}{hint}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"{'converted back' if args.reverse else 'converted'} {args.family}: {args.src} -> {args.dst}")
    return 0


def _is_expected(error: BaseException) -> bool:
    from .core import ConversionError

    return isinstance(error, (ConversionError, ValueError, TypeError, FileNotFoundError))


if __name__ == "__main__":
    sys.exit(main())

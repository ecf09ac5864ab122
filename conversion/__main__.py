"""`python -m conversion [FAMILY] SRC DST [--reverse] [--force] [--debug] [--dtype float32|bfloat16|float16]`

Forward: an official Hugging Face checkpoint (SRC) -> an hf_tiny checkpoint (DST).
Without FAMILY the family is detected from SRC (config.json's model_type, the GGUF architecture, Meta's layout;
with --reverse the hf_tiny model_type) and named on stderr.
--reverse: an hf_tiny checkpoint -> the official format (not every family has one).
A failure prints one line `error: ...` on stderr and exits with 1 (2 for usage errors); --debug shows the
traceback instead. Ctrl-C (SIGINT) or SIGTERM, at any moment, stops the run with one line and exit status 130 or
143; the destination is left as it was and the temporary folder is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import signal
import sys
import threading
from pathlib import Path

from .registry import FAMILIES, detect_family, family_module

EXIT_FAILURE = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad command line: exit code 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is, so that it is handled the same way."""


@contextlib.contextmanager
def _sigterm_interrupts():
    """While open, SIGTERM raises Terminated (in the main thread; elsewhere signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(_signum, _frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message and exits; we want one line and exit 2
        raise UsageError(f"{message} (see python -m conversion --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m conversion",
        description="Convert checkpoints between official Hugging Face formats and hf_tiny.",
    )
    parser.add_argument(
        "paths",
        nargs="*",
        metavar="[FAMILY] SRC DST",
        help=f"model family (detected when left out): {', '.join(FAMILIES)}; the source checkpoint folder (or file, "
        "e.g. a .gguf); the destination folder (written atomically)",
    )
    parser.add_argument(
        "--reverse", action="store_true", help="convert an hf_tiny checkpoint back to the official format"
    )
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating weights")
    parser.add_argument("--max-shard-size", metavar="SIZE",
                        help="largest weights file written, as save_pretrained's max_shard_size (e.g. 5GB; default 50GB)")
    parser.add_argument("--base-model", metavar="ID",
                        help="the source's Hub model id for the model card's base_model (default: the one a Hugging "
                        "Face cache path or config shows; none otherwise)")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on failure")
    return parser


def _load_family(family: str):
    try:
        return family_module(family)
    except KeyError:
        raise UsageError(f"unknown family {family!r}; known families: {', '.join(FAMILIES)}") from None


def resolve_paths(args: argparse.Namespace) -> None:
    """Splits the positional arguments into family, src and dst; detects the family when it is left out."""
    if len(args.paths) < 2:
        raise UsageError("the following arguments are required: SRC DST (see python -m conversion --help)")
    if len(args.paths) > 3:
        raise UsageError(f"expected [FAMILY] SRC DST, got {len(args.paths)} arguments: {' '.join(args.paths)}")
    if len(args.paths) == 3:
        args.family, args.src, args.dst = args.paths
        return
    args.src, args.dst = args.paths
    args.family, why = detect_family(args.src, reverse=args.reverse)
    print(f"detected family {args.family} ({why})", file=sys.stderr)


def run(args: argparse.Namespace) -> None:
    from .errors import ConversionError
    from .tensors import parse_dtype

    module = _load_family(args.family)
    if args.reverse:
        if args.dtype is not None:
            raise UsageError("--dtype applies only to the forward direction, not with --reverse")
        convert_back = getattr(module, "convert_back", None)
        if convert_back is None:
            raise UsageError(f"family {args.family!r} has no reverse conversion (--reverse)")
        if args.base_model is not None:
            raise UsageError("--base-model names the source of an hf_tiny folder's card; not with --reverse")
        return convert_back(args.src, args.dst, force=args.force, **_shard_size(convert_back, args))
    else:
        convert = getattr(module, "convert", None)
        if convert is None:
            raise ConversionError(f"converter module {FAMILIES[args.family]} defines no convert() function")
        kwargs = {"force": args.force, **_shard_size(convert, args)}
        if args.dtype is not None:
            if "dtype" not in inspect.signature(convert).parameters:
                raise UsageError(f"family {args.family!r} does not support --dtype")
            kwargs["dtype"] = parse_dtype(args.dtype)
        if args.base_model is not None:
            if "base_model" not in inspect.signature(convert).parameters:
                raise UsageError(f"family {args.family!r} does not support --base-model")
            kwargs["base_model"] = args.base_model
        return convert(args.src, args.dst, **kwargs)


def _shard_size(function, args: argparse.Namespace) -> dict:
    if args.max_shard_size is None:
        return {}
    if "max_shard_size" not in inspect.signature(function).parameters:
        raise UsageError(f"family {args.family!r} writes one weights file; --max-shard-size does not apply")
    return {"max_shard_size": args.max_shard_size}


def summary(args: argparse.Namespace, result) -> str:
    """The last line of a run: what was written, how big, and the parity verdict."""
    done = f"{'converted back' if args.reverse else 'converted'} {args.family}: {args.src} -> {args.dst}"
    if not isinstance(result, dict):
        return done
    sizes = []
    if result.get("bytes"):
        sizes.append(f"{result['bytes'] / 2**30:.2f} GiB of weights" if result["bytes"] >= 2**30
                     else f"{result['bytes'] / 2**20:.1f} MiB of weights")
    if result.get("files"):
        sizes.append(f"{len(result['files'])} weights file(s)")
    rows = result.get("parity") or []
    if rows:
        sizes.append(_parity_verdict(rows, result.get("card")))
    return done + (f" ({'; '.join(sizes)})" if sizes else "")


def _parity_verdict(rows: list[dict], card) -> str:
    """What the card's parity table says, in one phrase: passed, or how many runs are over tolerance (a lossy
    --dtype's rows are not failed; the card marks them "NO")."""
    from .cards import within_tolerance

    worst = max(rows, key=lambda row: row["max_abs_diff"] / max(row["tolerance"], 1e-30))
    over = sum(not within_tolerance(row) for row in rows)
    verdict = f"parity: {over} of {len(rows)} runs over tolerance" if over else f"parity passed: {len(rows)} run(s)"
    return (f"{verdict}, largest max |diff| {worst['max_abs_diff']:.3g} ({worst['backend']}, {worst['dtype']}; "
            f"tolerance {worst['tolerance']:.3g}; see {Path(card).name if card else 'the model card'})")


def _one_line(error: BaseException) -> str:
    from .errors import ConversionError

    text = " ".join(str(error).split()) or "(no message)"
    if isinstance(error, (ConversionError, UsageError, ValueError, TypeError, FileNotFoundError, RuntimeError)):
        return text
    return f"{type(error).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    with _sigterm_interrupts():
        try:
            args = build_parser().parse_intermixed_args(argv)  # options anywhere, e.g. between FAMILY and SRC
            resolve_paths(args)
            result = run(args)
        except UsageError as error:
            if debug:
                raise
            print(f"error: {_one_line(error)}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt as error:
            if debug:
                raise
            signum = signal.SIGTERM if isinstance(error, Terminated) else signal.SIGINT
            print(f"error: interrupted ({signum.name}); the destination was left as it was", file=sys.stderr)
            return 128 + signum
        except Exception as error:
            if debug:
                raise
            hint = "" if _is_expected(error) else " (run with --debug for the traceback)"
            print(f"error: {_one_line(error)}{hint}", file=sys.stderr)
            return EXIT_FAILURE
    print(summary(args, result))
    return 0


def _is_expected(error: BaseException) -> bool:
    from .errors import ConversionError

    return isinstance(error, (ConversionError, ValueError, TypeError, FileNotFoundError))


if __name__ == "__main__":
    sys.exit(main())

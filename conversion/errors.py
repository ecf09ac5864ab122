"""The one error type of the conversion package, and how its messages list names."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class ConversionError(Exception):
    """A conversion failed for a reason the user can act on; the message says which and where."""


# How many names an error message lists before it summarises the rest.
MAX_LISTED = 40


def list_names(names: Iterable[str], limit: int = MAX_LISTED) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return shown


def raise_problems(problems: Mapping[str, str]) -> None:
    """One ConversionError naming every problem found, `what: which` (an empty `which`: none found), joined by
    '; '; nothing when none was found."""
    found = [f"{what}: {which}" for what, which in problems.items() if which]
    if found:
        raise ConversionError("; ".join(found))

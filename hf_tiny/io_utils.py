"""Folders that appear complete or not at all: write into a temp folder beside the destination, then swap it in.

Used by `HfTinyPreTrainedModel.save_pretrained` and by the converters (conversion.writer.atomic_output_dir). A
process killed mid-write (even with SIGKILL) leaves the destination as it was, plus a `.NAME.tmp-PID-XXXXXXXX`
folder beside it that the next atomic write to the same destination removes (once PID is dead).

Shipped as remote code with the modeling files (modeling_base imports it): standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import secrets
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

_TEMP_NAME = re.compile(r"\.(?P<base>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}")
# A file name may hold 255 bytes (ext4, xfs, btrfs, APFS...); the temp name adds "." + ".tmp-PID-XXXXXXXX".
_NAME_MAX = 255
_TEMP_SUFFIX_MAX = len(".") + len(".tmp-") + 10 + len("-") + 8  # pid up to 10 digits


def _temp_base(name: str) -> str:
    """The name a temp folder of `name` carries: the name itself, or for a name too long to extend, a prefix of
    it plus a hash of the whole name (still unique to it, and recognisable by clean_stale_temporaries)."""
    if len(os.fsencode(name)) + _TEMP_SUFFIX_MAX <= _NAME_MAX:
        return name
    digest = hashlib.sha1(os.fsencode(name)).hexdigest()[:12]
    keep = _NAME_MAX - _TEMP_SUFFIX_MAX - len(digest) - 1
    prefix = os.fsdecode(os.fsencode(name)[:keep]).rstrip("\udcff")
    while len(os.fsencode(prefix)) > keep:  # a multi-byte character cut in half
        prefix = prefix[:-1]
    return f"{prefix}~{digest}"


def temp_name(dst: Path, kind: str = "tmp") -> Path:
    """A fresh sibling name `.NAME.KIND-PID-XXXXXXXX` that clean_stale_temporaries recognises, within the file
    system's 255-byte name limit however long NAME is."""
    return dst.parent / f".{_temp_base(dst.name)}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_owner(name: str, dst_name: str) -> tuple[str, bool] | None:
    """For a temp folder name beside dst: (kind, True if its writer is dead), or None if it is not dst's.

    Nested temp names (`..NAME.tmp-P-X.tmp-Q-Y`: an atomic save_pretrained into the temp folder of an atomic
    conversion) belong to dst too, and are stale as soon as any writer in the chain is dead.
    """
    match = _TEMP_NAME.fullmatch(name)
    if match is None:
        return None
    dead = not _alive(int(match.group("pid")))
    base = match.group("base")
    if base == _temp_base(dst_name):
        return match.group("kind"), dead
    if match.group("kind") != "tmp":
        return None
    inner = _stale_owner(base, dst_name)
    if inner is None:
        return None
    return "tmp", dead or inner[1]


def clean_stale_temporaries(dst: str | os.PathLike) -> None:
    """Removes temp folders beside dst left by killed writers (the pid in their name is dead).

    `.NAME.old-PID-*` is a previous destination moved aside during a replacing swap: if dst is missing (killed
    between the two renames of the fallback swap) it is put back; otherwise it is removed.
    """
    dst = Path(dst)
    if not dst.parent.is_dir():
        return
    for entry in sorted(dst.parent.iterdir(), key=lambda p: p.name):
        owner = _stale_owner(entry.name, dst.name)
        if owner is None or not owner[1]:
            continue  # not ours, or a writer still running
        if owner[0] == "old" and not dst.exists():
            os.rename(entry, dst)
        else:
            remove_entry(entry)


_RENAME_EXCHANGE = 2


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Atomically swaps two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(a))


def swap_into_place(tmp: Path, dst: Path, *, exchange: Callable[[Path, Path], bool] = exchange_paths) -> None:
    """Makes the finished folder tmp become dst, replacing an existing dst; the old dst is deleted afterwards.

    With renameat2 the swap is one atomic step; elsewhere two renames, with the old dst parked as
    `.NAME.old-PID-*` in between (put back by clean_stale_temporaries if the process dies there).
    """
    if not dst.exists():
        os.rename(tmp, dst)
        return
    if exchange(tmp, dst):
        remove_entry(tmp)  # tmp now holds the old destination
        return
    old = temp_name(dst, "old")
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    remove_entry(old)


def remove_entry(path: Path) -> None:
    """Removes a folder tree, a file or a symlink (never what a symlink points to); missing is fine."""
    if path.is_symlink() or path.is_file():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM (a plain `kill`, a job scheduler's stop) raises SystemExit(143) inside the block, so that cleanup
    runs as on Ctrl-C instead of leaving a model-sized temp folder behind. Only in the main thread, and only where
    nobody installed a SIGTERM handler of their own."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def atomic_directory(
    dst: str | os.PathLike,
    *,
    replace: bool,
    exchange: Callable[[Path, Path], bool] = exchange_paths,
) -> Iterator[Path]:
    """Yields a fresh empty temp folder beside dst; when the block succeeds it becomes dst, on any failure (or
    a kill) dst is left as it was and the temp folder is removed (or, after SIGKILL, by the next call).

    replace=False: a dst that exists (or appears while the block runs) raises FileExistsError, dst untouched.
    """
    dst = Path(dst).absolute()
    if dst.is_symlink():
        # Write where the link points (as a plain save into it would) and keep the link: swapping the link itself
        # away would replace the link, not the folder the user sees through it.
        dst = Path(os.path.realpath(dst))
    clean_stale_temporaries(dst)  # first: it may put back a destination a killed swap had moved aside
    if dst.exists() and not replace:
        raise FileExistsError(errno.EEXIST, "destination already exists", str(dst))
    if dst.exists() and not dst.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "destination exists and is not a folder", str(dst))
    created = [parent for parent in reversed(dst.parents) if not parent.exists()]  # outermost first
    dst.parent.mkdir(parents=True, exist_ok=True)
    with _sigterm_raises():
        tmp = temp_name(dst)
        tmp.mkdir()
        try:
            yield tmp
            if dst.exists() and not replace:
                raise FileExistsError(errno.EEXIST, "destination appeared while writing", str(dst))
            swap_into_place(tmp, dst, exchange=exchange)
        except BaseException:
            remove_entry(tmp)
            _remove_empty(created)
            raise


def _remove_empty(folders: list[Path]) -> None:
    """The folders a failed write created for its destination, innermost first, while they are empty (something
    else written into one meanwhile keeps it and those above it)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


def current_umask() -> int:
    """The process's umask. Read from /proc/self/status where the system has it (Linux), since os.umask can only
    read it by setting it, which races with other threads creating files; elsewhere set and put back at once."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def follow_umask(paths) -> None:
    """Gives each path (a folder: it and everything under it, symlinks left alone) the mode a plain open() or
    mkdir() would have given it under the current umask: 0o666 or 0o777 less the umask. Needed because safetensors
    (0.8, safetensors#782) writes its files through a temporary file created 0600 and renamed into place, and
    shutil's copy2 / copytree copy the source's modes, while everything else a save writes follows the umask."""
    mask = current_umask()

    def fix(path: str) -> None:
        if not os.path.islink(path):
            os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~mask)

    for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        fix(path)
        if os.path.isdir(path) and not os.path.islink(path):
            for root, folders, files in os.walk(path):
                for name in folders + files:
                    fix(os.path.join(root, name))


def link_or_copy_tree(src: Path, dst: Path) -> None:
    """Recreates src at dst (a path that does not exist yet) without touching src: files are hard-linked (copied
    where links are not possible), symlinks are recreated as symlinks, folders are recursed into."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        dst.mkdir()
        for child in src.iterdir():
            link_or_copy_tree(child, dst / child.name)
    else:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


__all__ = [
    "atomic_directory",
    "current_umask",
    "follow_umask",
    "remove_entry",
    "clean_stale_temporaries",
    "exchange_paths",
    "link_or_copy_tree",
    "swap_into_place",
    "temp_name",
]

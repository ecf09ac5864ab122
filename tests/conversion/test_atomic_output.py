"""Atomic outputs: a conversion (`python -m conversion bert SRC DST`) or a `save_pretrained` killed with SIGKILL in
the middle leaves the destination exactly as it was; an existing destination is replaced only with --force; a
plain save into an existing folder keeps what transformers' own save would keep (tokenizer files, Trainer
checkpoints) and drops stale weight shards.

The kill is deterministic: the child process runs the real entry point with `hf_tiny.io_utils.swap_into_place`
wrapped so that, when it is about to swap the finished temp folder into the watched destination, it reports the
temp folder and sleeps; the test then SIGKILLs it. Everything before the swap (weights, config, tokenizer,
parity measurement, model card) has been written by then, so the temp folder is as complete as it ever gets
while the destination must still be untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import transformers

import hf_tiny
from conversion.__main__ import main as conversion_main
from hf_tiny import io_utils

REPO_ROOT = Path(__file__).resolve().parents[2]


def snapshot(folder: Path) -> dict[str, str] | None:
    """{relative path: sha256 (or 'dir' / 'link -> target')} of everything under folder; None if absent."""
    if not os.path.lexists(folder):
        return None
    result = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            result[key] = f"link -> {os.readlink(path)}"
        elif path.is_dir():
            result[key] = "dir"
        else:
            result[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return result


def existing_destination(parent: Path) -> Path:
    dst = parent / "dst"
    (dst / "sub").mkdir(parents=True)
    (dst / "model.safetensors").write_bytes(b"previous weights")
    (dst / "config.json").write_text('{"previous": true}')
    (dst / "sub" / "note.txt").write_text("previous note")
    return dst


def official_bert_source(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=61, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=24, initializer_range=0.3,
    )
    src = tmp_path / "src"
    transformers.BertForMaskedLM(config).eval().save_pretrained(src)
    return src


def tiny_encoder(seed: int = 0) -> hf_tiny.TinyEncoderForMaskedLM:
    torch.manual_seed(seed)
    return hf_tiny.TinyEncoderForMaskedLM(
        hf_tiny.TinyEncoderConfig(
            vocab_size=61, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
            max_position_embeddings=24, initializer_range=0.3,
        )
    )


# The child: pause before the swap into the watched destination (argv[1]) and report the temp folder.
PAUSE_BEFORE_SWAP = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from hf_tiny import io_utils

    import os
    watched = {Path(sys.argv[1]).absolute(), Path(os.path.realpath(sys.argv[1]))}
    destination, ready = sys.argv[1], Path(sys.argv[2])
    sys.argv = [sys.argv[0]] + sys.argv[3:]
    real_swap = io_utils.swap_into_place

    def paused_swap(tmp, dst, **kwargs):
        if Path(dst) in watched:  # written whole, then renamed: the parent never reads it half-written
            ready.with_name(ready.name + ".part").write_text(str(tmp))
            os.replace(ready.with_name(ready.name + ".part"), ready)
            time.sleep(300)
        return real_swap(tmp, dst, **kwargs)

    io_utils.swap_into_place = paused_swap
    """
)

RUN_CLI = PAUSE_BEFORE_SWAP + textwrap.dedent(
    """
    from conversion.__main__ import main
    sys.exit(main())
    """
)

RUN_SAVE = PAUSE_BEFORE_SWAP + textwrap.dedent(
    """
    import torch, hf_tiny
    torch.manual_seed(1)
    config = hf_tiny.TinyEncoderConfig(
        vocab_size=61, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=24,
    )
    hf_tiny.TinyEncoderForMaskedLM(config).save_pretrained(destination)
    """
)


def run_until_paused_then_kill(
    script: str, watched: Path, ready: Path, *args: str, sig: int = signal.SIGKILL, expected_returncode=None
) -> Path:
    """Runs script in a child, waits until it reports the temp folder it is about to swap in, sends it sig
    (SIGKILL unless told otherwise) and checks its exit code (default: killed by sig)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(watched), str(ready), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            if process.poll() is not None:
                pytest.fail(f"child exited with {process.returncode} before pausing:\n{process.stderr.read()}")
            assert time.monotonic() < deadline, "child never reached the swap"
            time.sleep(0.05)
    finally:
        process.send_signal(sig)
        process.wait(timeout=60)
    assert process.returncode == (-sig if expected_returncode is None else expected_returncode), process.stderr.read()
    return Path(ready.read_text())


# ---------------------------------------------------------------------------------------------------------------
# Conversion CLI
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_conversion_killed_before_the_swap_leaves_dst_as_it_was(tmp_path, capsys):
    """(An absent destination staying absent after SIGKILL is tests/conversion/test_core.py's case.)"""
    src = official_bert_source(tmp_path)
    dst = existing_destination(tmp_path)
    before = snapshot(dst)

    temp_folder = run_until_paused_then_kill(
        RUN_CLI, dst, tmp_path / "ready", "bert", str(src), str(dst), "--force"
    )
    # the conversion really was complete but for the swap ...
    assert temp_folder.parent == tmp_path and temp_folder.name.startswith(".dst.tmp-")
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in temp_folder.iterdir()}
    # ... and the destination is exactly as it was
    assert snapshot(dst) == before

    # Without --force an existing destination is refused (exit 1, one line, untouched); the killed run's temp
    # folder is cleaned up first.
    capsys.readouterr()
    assert conversion_main(["bert", str(src), str(dst)]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: destination") and "already exists; pass --force" in error
    assert snapshot(dst) == before
    assert not temp_folder.exists()

    # With --force it is replaced by the full conversion, and nothing is left beside it.
    assert conversion_main(["bert", str(src), str(dst), "--force"]) == 0
    assert not temp_folder.exists()
    assert json.loads((dst / "config.json").read_text())["model_type"] == "hf_tiny_encoder"
    assert not (dst / "sub").exists()  # a conversion replaces the folder wholesale
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "ready", "src"]


@pytest.mark.slow
def test_cli_conversion_stopped_by_sigterm_cleans_up_its_temp_folder(tmp_path):
    """SIGTERM (kill, a scheduler's stop) is handled like Ctrl-C: exit 143, no model-sized temp folder left."""
    src = official_bert_source(tmp_path)
    dst = existing_destination(tmp_path)
    before = snapshot(dst)
    temp_folder = run_until_paused_then_kill(
        RUN_CLI, dst, tmp_path / "ready", "bert", str(src), str(dst), "--force",
        sig=signal.SIGTERM, expected_returncode=128 + signal.SIGTERM,
    )
    assert temp_folder.name.startswith(".dst.tmp-") and not temp_folder.exists()
    assert snapshot(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "ready", "src"]


def test_cli_conversion_into_a_symlinked_destination_with_force(tmp_path, capsys):
    """The folder the link points to is replaced, the link stays, and no temporary entry is left (the link itself
    used to be swapped away and left behind as `.link.tmp-PID-...`)."""
    src = official_bert_source(tmp_path)
    real = existing_destination(tmp_path)
    (tmp_path / "link").symlink_to(real)
    assert conversion_main(["bert", str(src), str(tmp_path / "link"), "--force"]) == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link").resolve() == real.resolve()
    assert json.loads((real / "config.json").read_text())["model_type"] == "hf_tiny_encoder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "link", "src"]


def test_long_destination_names_keep_temporary_names_within_the_limit(tmp_path, capsys):
    """A valid 240-character folder name: the temp name beside it must not exceed 255 bytes."""
    src = official_bert_source(tmp_path)
    long_name = "m" * 240
    assert conversion_main(["bert", str(src), str(tmp_path / long_name)]) == 0
    assert (tmp_path / long_name / "config.json").is_file()
    tiny_encoder().save_pretrained(tmp_path / ("s" * 240))
    assert (tmp_path / ("s" * 240) / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([long_name, "s" * 240, "src"]), [p.name[:30] for p in tmp_path.iterdir()]
    # a killed writer's temp folder of a long name is still recognised as stale and removed
    stale = io_utils.temp_name(tmp_path / long_name)
    assert len(stale.name) <= 255
    stale = stale.with_name(stale.name.replace(f"-{os.getpid()}-", "-999999999-"))
    stale.mkdir()
    io_utils.clean_stale_temporaries(tmp_path / long_name)
    assert not stale.exists()


# ---------------------------------------------------------------------------------------------------------------
# save_pretrained
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_save_pretrained_killed_before_the_swap_leaves_the_folder_as_it_was(tmp_path):
    dst = tmp_path / "dst"
    tiny_encoder(seed=0).save_pretrained(dst)
    (dst / "tokenizer.json").write_text("{}")
    before = snapshot(dst)

    temp_folder = run_until_paused_then_kill(RUN_SAVE, dst, tmp_path / "ready")
    assert (temp_folder / "model.safetensors").is_file() and (temp_folder / "config.json").is_file()
    assert snapshot(dst) == before
    reloaded = hf_tiny.TinyEncoderForMaskedLM.from_pretrained(dst)  # still the seed-0 model, loadable
    assert torch.equal(reloaded.lm_head.dense.weight, tiny_encoder(seed=0).lm_head.dense.weight)

    tiny_encoder(seed=2).save_pretrained(dst)  # the next save removes the dead writer's temp folder
    assert not temp_folder.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "ready"]
    reloaded = hf_tiny.TinyEncoderForMaskedLM.from_pretrained(dst)
    assert torch.equal(reloaded.lm_head.dense.weight, tiny_encoder(seed=2).lm_head.dense.weight)


def test_save_pretrained_failing_midway_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    dst = tmp_path / "dst"
    tiny_encoder(seed=0).save_pretrained(dst)
    before = snapshot(dst)

    def crash_after_half_the_weights(state_dict, filename, metadata=None):
        Path(filename).write_bytes(b"half of the weights")
        raise OSError("disk full")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", crash_after_half_the_weights)
    with pytest.raises(OSError, match="disk full"):
        tiny_encoder(seed=1).save_pretrained(dst)
    assert snapshot(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_save_pretrained_into_an_existing_folder_keeps_what_a_plain_save_keeps(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "tokenizer.json").write_text('{"kept": true}')
    (dst / "checkpoint-10").mkdir()
    (dst / "checkpoint-10" / "optimizer.pt").write_bytes(b"optimizer state")
    (dst / "latest").symlink_to("checkpoint-10")
    (dst / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")  # transformers deletes these
    (dst / "config.json").write_text('{"stale": true}')
    previous_optimizer_inode = (dst / "checkpoint-10" / "optimizer.pt").stat().st_ino

    model = tiny_encoder(seed=3)
    model.save_pretrained(dst)

    names = {p.name for p in dst.iterdir()}
    assert {"tokenizer.json", "checkpoint-10", "latest", "config.json", "model.safetensors"} <= names
    assert "model-00001-of-00002.safetensors" not in names
    assert (dst / "tokenizer.json").read_text() == '{"kept": true}'
    assert os.readlink(dst / "latest") == "checkpoint-10"
    # carried over by hard link, not copied: cheap even for large Trainer checkpoints
    assert (dst / "checkpoint-10" / "optimizer.pt").stat().st_ino == previous_optimizer_inode
    assert json.loads((dst / "config.json").read_text())["model_type"] == "hf_tiny_encoder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]
    reloaded = hf_tiny.TinyEncoderForMaskedLM.from_pretrained(dst)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_save_pretrained_over_the_folder_it_was_loaded_from(tmp_path):
    """The loaded weights may be memory-mapped from the folder being replaced; the card of a converted
    checkpoint (hf_tiny/hub.py) stays exactly as it was."""
    dst = tmp_path / "dst"
    tiny_encoder(seed=4).save_pretrained(dst)
    card = "---\ntags:\n  - hf_tiny\n---\n# card\n```python\nAutoModel.from_pretrained(\"someone/model\")\n```\n"
    (dst / "README.md").write_text(card)
    model = hf_tiny.TinyEncoderForMaskedLM.from_pretrained(dst)
    with torch.no_grad():
        model.lm_head.dense.weight.add_(1.0)
    model.save_pretrained(dst)
    assert (dst / "README.md").read_text() == card
    reloaded = hf_tiny.TinyEncoderForMaskedLM.from_pretrained(dst)
    assert torch.equal(reloaded.lm_head.dense.weight, model.lm_head.dense.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_save_pretrained_writes_through_a_symlinked_destination(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "keep.txt").write_text("kept")
    (tmp_path / "link").symlink_to(real)
    tiny_encoder().save_pretrained(tmp_path / "link")
    assert (tmp_path / "link").is_symlink()
    assert {"keep.txt", "config.json", "model.safetensors"} <= {p.name for p in real.iterdir()}


# ---------------------------------------------------------------------------------------------------------------
# The shared mechanism (hf_tiny/io_utils.py) on its own
# ---------------------------------------------------------------------------------------------------------------


def test_atomic_directory_refuses_an_existing_destination_unless_replacing(tmp_path):
    dst = existing_destination(tmp_path)
    before = snapshot(dst)
    with pytest.raises(FileExistsError, match="already exists"):
        with io_utils.atomic_directory(dst, replace=False):
            pytest.fail("the block must not run")
    assert snapshot(dst) == before
    with io_utils.atomic_directory(dst, replace=True) as tmp:
        (tmp / "new").write_text("1")
    assert snapshot(dst) == {"new": hashlib.sha256(b"1").hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_a_failed_write_removes_the_parent_folders_it_created_and_keeps_the_others(tmp_path):
    """A destination under folders that did not exist: a failure leaves the tree as it was (the folders it made for
    the destination removed); one that existed before, or that something else wrote into meanwhile, stays."""
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError, match="midway"):
        with io_utils.atomic_directory(tmp_path / "kept" / "a" / "b" / "dst", replace=False):
            raise RuntimeError("midway")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not any((tmp_path / "kept").iterdir())
    with pytest.raises(RuntimeError, match="midway"):
        with io_utils.atomic_directory(tmp_path / "kept" / "a" / "b" / "dst", replace=False):
            (tmp_path / "kept" / "a" / "other").write_text("someone else's")
            raise RuntimeError("midway")
    assert sorted(p.name for p in (tmp_path / "kept" / "a").iterdir()) == ["other"]


def test_atomic_directory_two_rename_fallback_replaces_and_restores(tmp_path, monkeypatch):
    dst = existing_destination(tmp_path)
    before = snapshot(dst)
    with io_utils.atomic_directory(dst, replace=True, exchange=lambda a, b: False) as tmp:
        (tmp / "new").write_text("1")
    assert snapshot(dst) == {"new": hashlib.sha256(b"1").hexdigest()}

    # the second rename fails: the previous destination is put back
    dst = existing_destination(tmp_path / "again")
    before = snapshot(dst)
    real_rename = os.rename

    def failing_second_rename(a, b):
        if ".tmp-" in str(a):
            raise OSError("rename failed")
        return real_rename(a, b)

    monkeypatch.setattr(io_utils.os, "rename", failing_second_rename)
    with pytest.raises(OSError, match="rename failed"):
        with io_utils.atomic_directory(dst, replace=True, exchange=lambda a, b: False) as tmp:
            (tmp / "new").write_text("1")
    assert snapshot(dst) == before
    assert sorted(p.name for p in dst.parent.iterdir()) == ["dst"]


def test_stale_nested_temp_folders_of_dead_writers_are_cleaned(tmp_path):
    """A conversion killed inside its own save_pretrained leaves `..dst.tmp-P-X.tmp-Q-Y` beside dst."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    dead, alive = process.pid, os.getpid()
    stale = [tmp_path / f".dst.tmp-{dead}-0123abcd", tmp_path / f"..dst.tmp-{alive}-0123abcd.tmp-{dead}-89abcdef",
             tmp_path / f"..dst.tmp-{dead}-0123abcd.tmp-{alive}-89abcdef"]
    running = [tmp_path / f".dst.tmp-{alive}-0123abcd", tmp_path / f"..dst.tmp-{alive}-0123abcd.tmp-{alive}-01234567"]
    others = [tmp_path / f".other.tmp-{dead}-0123abcd", tmp_path / "dst.tmp-1-0123abcd"]
    for folder in stale + running + others:
        folder.mkdir()
    io_utils.clean_stale_temporaries(tmp_path / "dst")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in running + others)

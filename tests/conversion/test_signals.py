"""Ctrl-C (SIGINT) and SIGTERM stop `python -m conversion` at any moment with one line, exit status 130 / 143, the
temporary folder removed and the destination as it was: while torch and transformers are still loading, and while
the parity runs compute side by side in their threads (streamed.run_in_lockstep). Real signals to a real child.

Each moment is reached deterministically: the loading moment by polling the child's memory maps until torch's
library is mapped (the child has entered the CLI and is importing); the parity moment by a child that wraps the
lockstep's gate so that the official reference run, at its second layer, reports and then waits (while the other
runs wait at their own gates) until the runs are told to stop. The child reports which parity threads are still
alive when the CLI returns: none may be (a run left computing while the interpreter exits aborts the process,
"terminate called without an active exception", exit -6).

In process, a signal that arrives while streamed.run_in_lockstep is still starting the runs' threads (the race that
the CI's 2 cores once hit) is reached deterministically by holding back the last thread's start until the first run
has sent it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
MESSAGE = "error: interrupted ({name}); the destination was left as it was"

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").is_file() or sys.platform == "win32",
                                reason="needs POSIX signals and /proc")

# The child: the CLI with the official run paused at its second layer until the runs are stopped (300 s at most);
# argv: ready file, then the CLI's arguments. Prints the parity threads alive when main() returned.
PAUSED_IN_PARITY = textwrap.dedent(
    """
    import json, sys, threading, time
    from pathlib import Path

    from conversion import streamed
    from conversion.__main__ import main

    ready = Path(sys.argv[1])
    real_gate = streamed._Lockstep.gate

    def gate(lockstep, run):
        wait, layers = real_gate(lockstep, run), []

        def paused():
            layers.append(None)
            if run == 0 and len(layers) == 2:
                ready.write_text("in parity")
                deadline = time.monotonic() + 300
                while not getattr(lockstep, "stopping", False) and time.monotonic() < deadline:
                    time.sleep(0.01)
            wait()

        return paused

    streamed._Lockstep.gate = gate
    code = main(sys.argv[2:])
    print(json.dumps([t.name for t in threading.enumerate() if t.name.startswith("parity-run")]))
    sys.exit(code)
    """
)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)
    folder = tmp_path_factory.mktemp("signals") / "src"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def sigint_as_in_a_terminal() -> None:
    """The child's SIGINT at its default (Python's KeyboardInterrupt), as a terminal's foreground job has it: a suite
    started as a shell's background job (`cmd &`) inherits SIGINT ignored, and so would the child, which then converts
    to the end (exit 0) where a user's Ctrl-C stops it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(condition, process: subprocess.Popen, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the child exited with {process.returncode} before {what}:\n{process.communicate()[1]}")
        assert time.monotonic() < deadline, f"the child never reached {what}"
        time.sleep(0.01)


def torch_is_loading(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def assert_stopped_cleanly(process: subprocess.Popen, sig: signal.Signals, dst: Path) -> str:
    """The child's exit status, last stderr line, destination and neighbours after sig; returns its stdout."""
    try:
        out, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"the child did not exit within 120 s of {sig.name}:\n{err}")
    assert process.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1] == MESSAGE.format(name=sig.name), err
    assert "terminate called" not in err
    assert not dst.exists()
    assert not [path.name for path in dst.parent.iterdir() if path.name.startswith(".dst.")], "a temporary folder was left"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_torch_loads_stops_with_one_line(sig, source, tmp_path):
    dst = tmp_path / "dst"
    process = subprocess.Popen([sys.executable, "-m", "conversion", str(source), str(dst)], cwd=tmp_path, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=sigint_as_in_a_terminal)
    wait_for(lambda: torch_is_loading(process.pid), process, "loading torch")
    process.send_signal(sig)
    assert_stopped_cleanly(process, sig, dst)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_parity_threads_run_stops_them_all_first(sig, source, tmp_path):
    dst, ready = tmp_path / "dst", tmp_path / "ready"
    process = subprocess.Popen([sys.executable, "-c", PAUSED_IN_PARITY, str(ready), str(source), str(dst)],
                               cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=sigint_as_in_a_terminal)
    wait_for(ready.exists, process, "the parity runs")
    process.send_signal(sig)
    out = assert_stopped_cleanly(process, sig, dst)
    assert json.loads(out.strip().splitlines()[-1]) == [], "parity threads were still running when the CLI returned"


class _SignalledWhileStarting(threading.Thread):
    """run_in_lockstep's thread class, patched: the last run's thread starts only after the first run has sent the
    signal, so that it arrives while the main thread is still starting the runs (the moment the CI's 2 cores once
    hit: the first run reached its second layer before the main thread got back from starting the second)."""

    sent = threading.Event()

    def start(self):
        if self.name.endswith("-1"):
            assert self.sent.wait(30), "the first run never sent its signal"
        super().start()


@pytest.fixture
def cli_handlers():
    """The handlers a CLI run in a terminal has: Ctrl-C's KeyboardInterrupt (set here too: a suite started as a shell's
    background job has SIGINT ignored), and SIGTERM raising Terminated (the CLI's own)."""
    from conversion.__main__ import _sigterm_interrupts

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with _sigterm_interrupts():
            yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_runs_start_stops_and_joins_every_run_before_it_is_raised(sig, cli_handlers, monkeypatch):
    """In process, deterministic: the first run sends sig to the process and then computes layer after layer; the
    second starts only once it was sent. run_in_lockstep raises the signal's exception only after every run saw the
    stop at its next layer and its thread ended; no run completes its 200 layers."""
    from conversion import streamed

    _SignalledWhileStarting.sent.clear()
    monkeypatch.setattr(streamed.threading, "Thread", _SignalledWhileStarting)
    ended = {}

    def job(index: int):
        def run(gate):
            try:
                for layer in range(200):
                    gate()
                    if index == 0 and layer == 0:
                        os.kill(os.getpid(), sig)
                        _SignalledWhileStarting.sent.set()
                    time.sleep(0.01)
            except streamed.RunsStopped:
                ended[index] = "stopped"
                raise
            ended[index] = "completed"

        return run

    with pytest.raises(KeyboardInterrupt) as raised:
        streamed.run_in_lockstep([job(0), job(1)])
    assert (sig == signal.SIGTERM) == (type(raised.value).__name__ == "Terminated")
    assert [t.name for t in threading.enumerate() if t.name.startswith("parity-run")] == []
    assert ended == {0: "stopped", 1: "stopped"}

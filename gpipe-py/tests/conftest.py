"""Shared fixtures: socket paths, child Python processes, the gpipe CLI, and a watchdog."""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Every test is killed (with a traceback of every thread) if it runs this long: a hang fails
# the run instead of stalling it.
WATCHDOG_S = 120


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def sock(tmp_path_factory) -> str:
    # Unix socket paths are limited to 107 bytes: keep them short.
    d = Path("/tmp") / f"gp-{os.getpid()}"
    d.mkdir(exist_ok=True)
    return str(d / f"{uuid.uuid4().hex[:10]}.sock")


class Child:
    """A Python child process in its own process group (killed with the group at the end).
    Its stdout is read line by line on a thread, so `readline` never blocks on data that is
    already buffered."""

    def __init__(self, code: str, *args: str, env=None):
        import queue
        import threading

        # Ctrl-C raises KeyboardInterrupt in the child even when this test run was started
        # with SIGINT ignored (a shell's background job), which the child would inherit.
        code = "import signal as _s; _s.signal(_s.SIGINT, _s.default_int_handler)\n" + textwrap.dedent(code)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self._stdin = self.proc.stdin
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []

        def pump(stream, sink, q=None):
            for line in stream:
                sink.append(line)
                if q is not None:
                    q.put(line)
            if q is not None:
                q.put(None)

        self.threads = [
            threading.Thread(target=pump, args=(self.proc.stdout, self.out, self.lines), daemon=True),
            threading.Thread(target=pump, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def readline(self, timeout: float = 20.0) -> str:
        import queue

        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"child printed nothing in {timeout}s; stderr: {''.join(self.err)[-3000:]}")
        if line is None:
            self.proc.wait(timeout=10)
            raise AssertionError(
                f"child exited ({self.proc.returncode}) before printing a line; stderr: {''.join(self.err)[-3000:]}"
            )
        return line.strip()

    def wait(self, timeout: float = 60.0) -> tuple[int, str, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            for t in self.threads:
                t.join(timeout=5)
            raise AssertionError(f"child did not finish in {timeout}s; stderr: {''.join(self.err)[-3000:]}")
        for t in self.threads:
            t.join(timeout=10)
        return self.proc.returncode, "".join(self.out), "".join(self.err)

    def release_stdin(self) -> None:
        """Sends a line to the child's stdin (a child may wait on it to be told to go on)."""
        self._stdin.write("go\n")
        self._stdin.flush()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def child():
    children: list[Child] = []

    def start(code: str, *args: str, env=None) -> Child:
        c = Child(code, *args, env=env)
        children.append(c)
        return c

    yield start
    for c in children:
        c.kill()
        try:
            c.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _wheel_cli() -> str | None:
    """The CLI of an installed wheel: its `gpipe` console script (the command a pip user runs),
    else (`pip install --target`, whose scripts are elsewhere) the bundled binary itself; None
    for a build from source, which bundles none."""
    try:
        from gpipe._cli import bundled_binary
    except ImportError:
        return None
    binary = bundled_binary()
    if binary is None:
        return None
    return shutil.which("gpipe", path=sysconfig.get_path("scripts")) or str(binary)


def _find_gpipe() -> str | None:
    env = os.environ.get("GPIPE_BIN")
    if env:
        return env
    wheel_cli = _wheel_cli()
    if wheel_cli:
        return wheel_cli
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / "gpipe"
        if p.exists():
            return str(p)
    return shutil.which("gpipe")


@pytest.fixture
def gpipe_bin() -> str:
    path = _find_gpipe()
    if path is None:
        pytest.skip(
            "no gpipe CLI: the installed gpipe is not the wheel (scripts/wheel), the CLI is not built "
            "(cargo build -p pipeline-examples) and gpipe is not on PATH"
        )
    return path


@pytest.fixture
def make_ring(sock):
    """`make_ring(slots=4, consumer={...}, **producer_kwargs)` gives (producer, consumer) on one
    ring. Both are
    closed after the test, once its arrays are gone (a held tensor keeps its batch, and the
    producer's close waits for consumers to let go)."""
    import gpipe

    made = []

    def make(slots: int = 4, batch_bytes: int = 1 << 20, consumer=None, **kw):
        kw.setdefault("backend", "host")
        p = gpipe.Producer(sock, slots=slots, batch_bytes=batch_bytes, **kw)
        c = gpipe.Consumer(sock, **(consumer or {}))
        p.wait_for_consumers(1, timeout=5)
        made.append((p, c))
        return p, c

    yield make
    for p, c in made:
        c.close()
        p.close()


@pytest.fixture
def report():
    """`report(line)`: a measured figure worth keeping, appended to $GPIPE_REPORT when set
    (the GPU scripts collect them) and printed."""

    def write(line: str) -> None:
        print(line)
        path = os.environ.get("GPIPE_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")

    return write

"""The package as `pip install` of the wheel gives it: the `gpipe` command runs the bundled CLI
in place (same process, signals and exit status), a build from source says where to get the
CLI, and (where scripts/test sets GPIPE_EXPECT_WHEEL=1) the suite runs against the installed
wheel on a PATH without cargo."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest

import gpipe
from gpipe import _cli

ROOT = Path(__file__).resolve().parents[2]
EXPECT_WHEEL = os.environ.get("GPIPE_EXPECT_WHEEL") == "1"


@pytest.fixture
def gpipe_command() -> str:
    """The `gpipe` console script of the installed wheel."""
    if _cli.bundled_binary() is None:
        if EXPECT_WHEEL:
            pytest.fail("GPIPE_EXPECT_WHEEL=1 but the installed gpipe has no bundled CLI (gpipe/_bin/gpipe)")
        pytest.skip("this gpipe was built from source: only the wheel (scripts/wheel) bundles the CLI")
    # The environment's scripts directory; `pip install --target DIR` puts them in DIR/bin.
    places = [sysconfig.get_path("scripts"), str(Path(gpipe.__file__).resolve().parents[1] / "bin")]
    script = next(filter(None, (shutil.which("gpipe", path=p) for p in places)), None)
    assert script is not None, f"the wheel's console script gpipe is in none of {places}"
    return script


def test_the_installed_package_is_the_wheel_and_cargo_is_absent():
    if not EXPECT_WHEEL:
        pytest.skip("set by scripts/test, which installs the wheel and removes cargo from PATH")
    package = Path(gpipe.__file__).resolve()
    assert ROOT / "gpipe-py" not in package.parents, f"gpipe was imported from the source tree: {package}"
    assert Path(gpipe._gpipe.__file__).name == "_gpipe.abi3.so", gpipe._gpipe.__file__
    assert _cli.bundled_binary() is not None, "the installed wheel has no bundled gpipe CLI"
    assert shutil.which("cargo") is None, f"cargo is on PATH ({shutil.which('cargo')}): the suite must run without it"


def test_the_gpipe_command_runs_the_bundled_cli(gpipe_command):
    version = subprocess.run([gpipe_command, "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0, version.stderr
    assert version.stdout.split() == ["gpipe", gpipe.__version__], version.stdout
    for command in ("probe", "inspect"):
        done = subprocess.run([gpipe_command, command, "--help"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert f"Usage: gpipe {command}" in done.stdout, done.stdout
    # A usage error keeps the CLI's own exit status and message.
    wrong = subprocess.run([gpipe_command, "no-such-command"], capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2, (wrong.returncode, wrong.stderr)
    assert "no-such-command" in wrong.stderr, wrong.stderr


def test_the_gpipe_command_keeps_its_process_and_answers_ctrl_c(gpipe_command, sock):
    proc = subprocess.Popen(
        [gpipe_command, "produce", "--backend", "host", "--socket", sock, "--slots", "2", "--batch-bytes", "1MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            assert proc.poll() is None, f"gpipe produce exited ({proc.returncode}): {proc.stdout.read()}"
            assert time.monotonic() < deadline, "gpipe produce did not create its socket in 20 s"
            time.sleep(0.05)
        # The console script replaced itself with the binary: the pid Popen knows is the CLI's.
        assert Path(f"/proc/{proc.pid}/exe").resolve() == _cli.bundled_binary().resolve()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
        assert "producer stopped" in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_a_build_from_source_says_where_to_get_the_cli(monkeypatch, capsys):
    monkeypatch.setattr(_cli, "bundled_binary", lambda: None)
    with pytest.raises(SystemExit) as exit:
        _cli.main()
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "no gpipe CLI" in err and "scripts/wheel" in err and "cargo build --release -p pipeline-examples" in err, err


def test_a_cli_that_lost_its_mode_says_so(monkeypatch, capsys, tmp_path):
    binary = tmp_path / "gpipe"
    binary.write_bytes(b"\x7fELF")
    binary.chmod(0o644)
    monkeypatch.setattr(_cli, "bundled_binary", lambda: binary)
    with pytest.raises(SystemExit) as exit:
        _cli.main()
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert str(binary) in err and "not executable" in err, err

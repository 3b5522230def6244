"""`gpipe.resolve` and `gpipe probe`: one policy resolves every "auto" for the Python package
and the command line, so both print the same resolution for the same arguments."""

from __future__ import annotations

import json
import subprocess

import pytest

import gpipe

MIB = 1 << 20


def h100_report(mps: bool = False, vmm: bool = True) -> dict:
    """A saved `gpipe probe --json` report of one H100 (what `--report` reads)."""
    device = {
        "ordinal": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": "GPU-00000000-0000-0000-0000-000000000000",
        "compute_capability": [9, 0],
        "total_memory_bytes": 80 << 30,
        "multiprocessors": 132,
        "l2_cache_bytes": 50 * MIB,
        "memory_pools": True,
        "pool_handle_types": 0x9,
        "pool_posix_fd": True,
        "pool_fabric": True,
        "virtual_memory_management": vmm,
        "posix_fd_handles": True,
        "fabric_handles": True,
        "ipc_events": True,
        "stream_mem_ops_64bit": True,
        "legacy_ipc": True,
        "mps_enabled": mps,
        "imex_channel": False,
        "notes": [],
    }
    return {
        "driver_version": 13000,
        "nvrtc_version": [13, 0],
        "nvrtc_error": None,
        "mps_control_pipe": None,
        "devices": [device],
        "peers": [],
    }


@pytest.fixture
def report(tmp_path):
    def write(**kw) -> str:
        path = tmp_path / "probe.json"
        path.write_text(json.dumps(h100_report(**kw)))
        return str(path)

    return write


def cli_resolution(gpipe_bin: str, *args: str) -> dict:
    out = subprocess.run(
        [gpipe_bin, "probe", "--json", *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["resolution"]


def test_the_host_backend_resolves_without_a_gpu():
    r = gpipe.resolve(backend="host", slots="auto", max_lead="auto")
    assert r["backend"] == {"value": "host", "auto": False, "reason": "given"}
    assert r["slots"]["value"] == 8 and r["slots"]["reason"] == "the host backend"
    assert r["max_lead"]["value"] is None
    assert r["cuda"] is None


def test_a_saved_report_resolves_each_auto_with_its_reason(report, monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    r = gpipe.resolve(
        backend="cuda", slots="auto", batch_bytes=8 * MIB, max_lead="auto",
        timeline_memory="auto", report=report(),
    )
    assert r["slots"]["auto"] and r["slots"]["reason"].startswith("MPS is not running")
    assert r["max_lead"]["auto"] and "50 MiB L2" in r["max_lead"]["reason"]
    cuda = r["cuda"]
    # Python's front-end: a broadcast ring on VMM, ready as timeline words.
    assert cuda["memory"]["value"] == "vmm"
    assert cuda["sync"]["value"] == "semaphore"
    assert "producer dies" in cuda["sync"]["reason"]
    # Python's default timeline memory is host (given, not auto).
    host = gpipe.resolve(backend="cuda", report=report())["cuda"]["timeline_memory"]
    assert host == {"value": "host", "auto": False, "reason": "given"}
    with_mps = gpipe.resolve(backend="cuda", slots="auto", report=report(mps=True))
    assert with_mps["slots"]["reason"] == "MPS is running"


def test_python_and_the_cli_resolve_alike(report, gpipe_bin, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    path = report()
    for batch in (2 * MIB, 64 * MIB):
        py = gpipe.resolve(
            backend="cuda", slots="auto", batch_bytes=batch, max_lead="auto",
            timeline_memory="auto", report=path,
        )
        args = ["--report", path, "--slots", "auto", "--batch-bytes", str(batch),
                "--max-lead", "auto"]
        assert cli_resolution(gpipe_bin, *args, "--python") == py
        # The command line's own front-end differs only where it says: the memory path and
        # `sync auto`.
        cli = cli_resolution(gpipe_bin, *args)
        for key in ("backend", "slots", "max_lead", "side_signals", "side_signals_queues"):
            assert cli[key] == py[key], key
        assert cli["cuda"]["memory"]["value"] == "pool"


@pytest.mark.skipif(
    not gpipe.resolve()["backend"]["value"] == "cuda", reason="needs a CUDA GPU"
)
def test_python_and_the_cli_resolve_alike_on_this_gpu(gpipe_bin):
    py = gpipe.resolve(
        backend="cuda", slots="auto", batch_bytes=64 * MIB, max_lead="auto",
        timeline_memory="auto",
    )
    cli = cli_resolution(
        gpipe_bin, "--slots", "auto", "--batch-bytes", str(64 * MIB), "--max-lead", "auto",
        "--python",
    )
    assert cli == py

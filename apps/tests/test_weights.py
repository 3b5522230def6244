"""The weight-update benchmark (apps/weights) at the tiny size.

On the host backend (CI): run_all.py runs every peer as real processes under time limits:
the in-process copy, torch.multiprocessing shared memory, gloo broadcast, gpipe loaded into
the receiver's tensors and read in place; then a receiver SIGKILLed mid-run (the trainer and
the other receivers go on and verify every update) and the trainer SIGKILLed right after a
publish (every receiver ends with a clear error and a model that holds one whole version).
Every update of every run is checked by the marks the trainer writes. With a CUDA device the
same runs on the GPU (and NCCL and gpipe to the other GPUs with two or more).
"""

from __future__ import annotations

import faulthandler
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gpipe")

APP = Path(__file__).resolve().parents[1] / "weights"
sys.path.insert(0, str(APP))

import state  # noqa: E402

# A test that runs longer than this dies with every thread's traceback instead of hanging.
WATCHDOG_S = 280
UPDATES = 12


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def test_marks_name_their_version_and_tell_a_torn_load():
    sd = state.make_state("tiny", torch.device("cpu"), fill="zeros")
    tensors = list(sd.values())
    assert len(tensors) > 8 and {t.dtype for t in tensors} == {torch.bfloat16, torch.float32, torch.int64}
    marks = state.Marks(tensors)
    assert marks.consistent_version() == -1  # zeros: no version yet
    for v in (1, 249, 250, 251, 777):
        marks.write(v)
        assert marks.check(v) is None
        assert marks.consistent_version() == v % 250
        assert marks.check(v + 1) is not None
    tensors[3].view(-1)[-1] = state.mark_of(776, 3)  # one tensor of an older version
    assert marks.consistent_version() is None
    assert "tensor 3" in marks.check(777)


def run_all(tmp_path: Path, device: str, timeout: float) -> tuple[dict, str]:
    out = tmp_path / "out"
    cmd = [sys.executable, str(APP / "run_all.py"), "--device", device, "--sizes", "tiny",
           "--fault-size", "tiny", "--updates", str(UPDATES), "--warmup", "2",
           "--fault-updates", "12", "--fault-at", "5", "--run-timeout", "90",
           "--budget", str(timeout - 20), "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    recs = {}
    for line in (out / "weights.jsonl").read_text().splitlines():
        r = json.loads(line)
        recs[r.get("tag", r["run"])] = r  # an amended record replaces the first
    text = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    assert p.returncode == 0, f"run_all failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-3000:]}"
    return recs, text


def check_runs(recs: dict, expect: list[str]) -> None:
    for tag in expect:
        r = recs[tag]
        assert r.get("ok"), (tag, r.get("problems"))
        assert "skipped" not in r, tag
        u = r["update_ms"]
        assert u["n"] == UPDATES - 2 and 0 < u["p50"] <= u["p99"] < 10_000, (tag, u)
        assert r["tensors"] == len(state.shapes("tiny"))
        assert r["verified_updates"] >= UPDATES, (tag, r["verified_updates"])
        for side, m in r["memory"].items():
            assert m["updates"] >= UPDATES - 2, (tag, side)


def check_faults(recs: dict) -> None:
    k = recs["fault-kill-receiver"]
    assert k["ok"], k.get("problems")
    assert k["killed_receiver"] == 0
    assert k["counters"]["died"] == 1  # the trainer's ring let the dead receiver go
    assert k["verified_updates"] >= 2 * 12  # the others got and checked every update
    t = recs["fault-kill-trainer"]
    assert t["ok"], t.get("problems")
    assert t["trainer_rc"] == -9
    assert len(t["receivers_after"]) >= 3  # with one behind a forwarder where there is one
    for rx in t["receivers_after"]:
        assert rx["error"]["type"] in ("ProducerDied", "WeightError"), rx
        assert "trainer" in rx["error"]["message"], rx
        assert rx["last_version"] in (4, 5), rx
        if rx["receiver"].startswith("load"):
            assert rx["model_whole"] is True, rx


def test_every_peer_and_the_faults_on_the_host_backend(tmp_path):
    recs, text = run_all(tmp_path, "cpu", timeout=260)
    check_runs(recs, ["ceiling-tiny", "ipc-tiny", "gpipe-same-load-tiny", "gpipe-same-inplace-tiny",
                      "gpipe-same-load-inslot-tiny", "gpipe-same-inplace-inslot-tiny", "nccl-tiny",
                      "gpipe-others-plan-tiny", "gpipe-others-chunked-tiny"])
    check_faults(recs)
    for tag in ("gpipe-others-plan-tiny", "gpipe-others-chunked-tiny"):
        plan = recs[tag]  # two forwarders in host memory, one after the other
        assert len(plan["rings"]) == 3 and [f["batches"] for f in plan["forwarders"]] == [UPDATES] * 2
    assert recs["gpipe-others-chunked-tiny"]["chunk"] == 16 << 10
    assert recs["nccl-tiny"]["collective"] == "gloo"
    for tag in ("gpipe-same-load-tiny", "gpipe-same-inplace-tiny"):
        assert recs[tag]["counters"]["published"] == UPDATES
        assert recs[tag]["pack_ms"]["p50"] > 0
    assert "gpipe-same-load-tiny" in text and "fault-kill-trainer: PASS" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_peer_and_the_faults_on_the_gpu(tmp_path):
    recs, _ = run_all(tmp_path, "cuda", timeout=420)
    expect = ["ceiling-tiny", "ipc-tiny", "gpipe-same-load-tiny", "gpipe-same-inplace-tiny",
              "gpipe-same-load-inslot-tiny", "gpipe-same-inplace-inslot-tiny"]
    if torch.cuda.device_count() >= 2:
        expect += ["nccl-tiny", "gpipe-others-direct-tiny", "gpipe-others-plan-tiny",
                   "gpipe-others-chunked-tiny", "gpipe-others-chunked-inplace-tiny",
                   "gpipe-others-chunked-inplace-inslot-tiny"]
    check_runs(recs, expect)
    check_faults(recs)
    assert recs["gpipe-same-load-tiny"]["memory_path"] in ("vmm", "pool", "legacy")

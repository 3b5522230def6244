"""The inference fan-out application (apps/fanout) at tiny sizes.

On the host backend (CPU tensors, CI): a source and three model processes over a gpipe ring,
the torch.multiprocessing baseline and the in-process baselines, all as real processes under
time limits. Each consumer must see every frame, in order, with the right marker in the
frame and the right header, and produce the outputs this process computes for the same
frames; latency figures must be there and sane. The CUDA tests (skipped without a GPU) do
the same in graph mode, where each consumer replays one captured graph per slot.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gpipe")

APP = Path(__file__).resolve().parents[1] / "fanout"
sys.path.insert(0, str(APP))


def _load(name: str, path: Path):
    """Imports apps/fanout/<file> under its own name (apps/loader has a run_all.py too)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


run_all = _load("fanout_run_all", APP / "run_all.py")
from fanout_common import SyntheticFrames, build_model, dtype_of  # noqa: E402
from fanout_records import latency_summary, percentile  # noqa: E402

H, W, SIZE, SLOTS, WARMUP, FRAMES = 36, 64, 32, 4, 6, 12
# A test that runs longer than this dies with every thread's traceback instead of hanging.
WATCHDOG_S = 150


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def config(tmp_path, backend: str = "host") -> run_all.Config:
    return run_all.Config(
        backend=backend,
        dtype="float16",
        height=H,
        width=W,
        size=SIZE,
        slots=SLOTS,
        warmup=WARMUP,
        threads=1,
        logdir=str(tmp_path / "logs"),
        run_timeout=60.0,
        check=True,
    )


def expected_outputs(n: int, device: str = "cpu") -> list[int]:
    """The tiny model's class for frames 0..n-1, computed here."""
    dev = torch.device(device)
    dtype = dtype_of("float16")
    frames = SyntheticFrames((3, H, W), dtype, dev)
    model = build_model("tiny", dev, dtype, SIZE)
    buf = torch.zeros((3, H, W), dtype=dtype, device=dev)
    out = []
    with torch.inference_mode():
        for i in range(n):
            frames.fill(buf, i)
            out.append(int(model(buf)))
    return out


def logs(tmp_path) -> str:
    text = []
    for p in sorted((tmp_path / "logs").glob("*.err")):
        text.append(f"--- {p.name}\n{p.read_text()[-1500:]}")
    return "\n".join(text)


def assert_every_frame(rec: dict, n_models: int, latency: bool, timed: int = FRAMES) -> None:
    assert rec["ok"], rec
    assert rec["timed"] == timed
    assert len(rec["consumers"]) == n_models
    for c in rec["consumers"]:
        assert c["end"] == "closed", c
        assert c["frames"] == WARMUP + timed and c["timed"] == timed, c
        assert c["first_frame"] == 0 and c["last_frame"] == WARMUP + timed - 1, c
        assert c["out_of_order"] == 0 and c["check_failures"] == 0, c
        if latency:
            lat = c["latency"]
            assert lat["n"] == timed, c
            assert 0 < lat["p50_us"] <= lat["p99_us"] <= lat["max_us"] < 5e6, c
        else:
            assert c["latency"] is None, c


def assert_tiny_outputs(rec: dict, want: list[int], agree: float = 1.0) -> None:
    for c in rec["consumers"]:
        if c["model"] != "tiny":
            continue
        got = c["outputs_head"]
        assert len(got) == min(len(want), 32), c
        same = sum(g == w for g, w in zip(got, want))
        assert same >= agree * len(got), (got, want)


def test_gpipe_fanout_at_a_fixed_rate_every_frame_in_order_with_latency(tmp_path):
    rec = run_all.run_gpipe(
        config(tmp_path),
        "eager",
        ["tiny", "tiny", "empty"],
        rate=200.0,
        frames=FRAMES,
        latency=True,
    )
    assert rec.get("ok"), f"{rec}\n{logs(tmp_path)}"
    assert_every_frame(rec, 3, latency=True)
    assert_tiny_outputs(rec, expected_outputs(WARMUP + FRAMES))
    assert rec["memory"] == "host" and rec["rate"] == 200.0
    assert rec["fps"] and rec["fps"] > 0
    # Where each frame's latency went: the steps, in order, add up to the whole.
    for c in rec["consumers"]:
        steps = c["latency_steps"]
        assert list(steps) == ["recv", "view", "model_release", "result"], c
        assert all(v["n"] == FRAMES and v["max_us"] >= 0 for v in steps.values()), c
        total = sum(v["mean_us"] for v in steps.values())
        assert abs(total - c["latency"]["mean_us"]) <= 0.5, (total, c)
    assert rec["publish_call"]["n"] == FRAMES and rec["publish_call"]["p50_us"] > 0, rec


def test_mp_queue_baseline(tmp_path):
    recs = run_all.run_baseline(
        config(tmp_path),
        [
            "mp-queue",
            "--models",
            "tiny,empty",
            "--latency",
            "--rate",
            "200",
            "--frames",
            str(FRAMES),
            "--check",
        ],
        "mp",
        timeout=90,
    )
    assert len(recs) == 1, f"{recs}\n{logs(tmp_path)}"
    rec = recs[0]
    assert rec.get("ok"), f"{rec}\n{logs(tmp_path)}"
    assert rec["run"] == "mp-queue"
    assert_every_frame(rec, 2, latency=True)
    assert_tiny_outputs(rec, expected_outputs(WARMUP + FRAMES))


def test_inproc_baselines(tmp_path):
    recs = run_all.run_baseline(
        config(tmp_path),
        ["inproc", "--models", "tiny,tiny,empty", "--modes", "eager", "--frames", str(FRAMES)],
        "inproc",
    )
    assert [(r["run"], r["models"]) for r in recs] == [
        ("solo", ["tiny"]),
        ("solo", ["tiny"]),
        ("sequential", ["tiny", "tiny"]),
    ], f"{recs}\n{logs(tmp_path)}"
    want = expected_outputs(WARMUP + FRAMES)
    for r in recs:
        assert r["ok"] and r["timed"] == FRAMES and r["fps"] > 0, r
        for c in r["consumers"]:
            assert c["outputs_head"] == want[: len(c["outputs_head"])] and c["outputs_head"], r


def run_all_quick(out: Path, *args: str) -> list[dict]:
    """run_all.py on the host backend at the tiny sizes, eager, --quick, every frame checked,
    with `args`; its records (the run must succeed)."""
    code = run_all.main(
        [
            "--backend", "host", "--modes", "eager", "--quick", *args,
            "--height", str(H), "--width", str(W), "--size", str(SIZE),
            "--slots", str(SLOTS), "--warmup", str(WARMUP),
            "--out", str(out), "--run-timeout", "60", "--check",
        ]
    )  # fmt: skip
    recs = [json.loads(line) for line in (out / "fanout.jsonl").read_text().splitlines()]
    assert code == 0, f"{recs}\n{logs(out / 'logs' / 'mps-off')}"
    return recs


def test_run_all_writes_records_and_a_summary(tmp_path):
    recs = run_all_quick(
        tmp_path / "out", "--models", "tiny,empty", "--only", "gpipe,empty", "--rate", "200"
    )
    assert [(r["run"], r["models"], r["latency_run"]) for r in recs] == [
        ("gpipe", ["tiny", "empty"], False),
        ("gpipe", ["empty", "empty"], True),
        ("mp-queue", ["empty", "empty"], True),
    ]
    assert all(r["mps"] == "off" and r["quick"] for r in recs)
    fastest = recs[0]  # the source as fast as possible: no latency, every frame still there
    assert_every_frame(fastest, 2, latency=False)
    assert_tiny_outputs(fastest, expected_outputs(WARMUP + FRAMES))
    assert fastest["fps"] > 0 and all(c["fps"] > 0 for c in fastest["consumers"])
    for r in recs[1:]:
        assert_every_frame(r, 2, latency=True, timed=100)  # 200 frames/s for 0.5 s (--quick)
    lines = run_all.summary(recs, ["tiny"], "off")
    assert any("added latency, gpipe (2 empty models)" in ln for ln in lines), lines


def test_the_models_alone_at_once_and_gpipe_in_place_with_wait_shares(tmp_path):
    recs = run_all_quick(
        tmp_path / "out", "--models", "tiny,tiny", "--only", "together,gpipe", "--delivery", "in-place"
    )
    assert [r["run"] for r in recs] == ["together", "gpipe"]
    together, fan = recs
    # each model alone in a process of its own, both timing the same seconds
    assert together["ok"] and [c["model"] for c in together["consumers"]] == ["tiny", "tiny"]
    assert all(c["fps"] > 0 for c in together["consumers"])
    assert together["fps"] == min(c["fps"] for c in together["consumers"])
    # the consumers delivered in place, and each says how much of its time it waited
    assert fan["delivery"] == "in-place"
    assert_every_frame(fan, 2, latency=False)
    assert all(0 <= c["wait_share"] <= 1 for c in fan["consumers"])
    lines = run_all.summary(recs, ["tiny", "tiny"], "off")
    assert any("the models alone at once, no transport" in ln for ln in lines), lines


def test_summary_targets():
    def consumer(model, fps=None, p99=None):
        lat = (
            {"n": 10, "p50_us": p99 / 2, "p99_us": p99, "max_us": p99, "mean_us": p99}
            if p99
            else None
        )
        return {"model": model, "fps": fps, "latency": lat}

    recs = [
        {"run": "solo", "mode": "eager", "models": ["a"], "fps": 200.0, "ok": True},
        {"run": "solo", "mode": "eager", "models": ["b"], "fps": 180.0, "ok": True},
        {"run": "streams", "mode": "graph", "models": ["a", "b"], "fps": 1000.0, "ok": True},
        {"run": "gpipe", "mode": "eager", "models": ["a", "b"], "fps": 170.0, "ok": True,
         "consumers": [consumer("a", 171.0), consumer("b", 170.0)]},
        {"run": "gpipe", "mode": "graph", "models": ["a", "b"], "fps": 850.0, "ok": True,
         "consumers": [consumer("a", 900.0), consumer("b", 850.0)]},
        {"run": "gpipe", "mode": "eager", "models": ["empty", "empty"], "rate": 100.0, "ok": True,
         "latency_run": True,
         "consumers": [consumer("empty", p99=40.0), consumer("empty", p99=120.0)]},
    ]  # fmt: skip
    text = "\n".join(run_all.summary(recs, ["a", "b"], "on"))
    assert "gpipe fan-out 170.0 / slowest model alone 180.0 = 0.94 (target >= 0.9) PASS" in text
    assert "gpipe fan-out 850.0 / three-stream replay 1000.0 = 0.85 (target >= 0.9) MISS" in text
    assert "p99 worst 120.0 µs (target <= 100) MISS" in text
    # With --repeat, each figure is the median of its repetitions.
    more = [
        {"run": "solo", "mode": "eager", "models": ["b"], "fps": 150.0, "ok": True,
         "repetition": 1},
        {"run": "solo", "mode": "eager", "models": ["b"], "fps": 100.0, "ok": True,
         "repetition": 2},
        {"run": "gpipe", "mode": "eager", "models": ["a", "b"], "fps": 140.0, "ok": True,
         "repetition": 1, "consumers": []},
        {"run": "gpipe", "mode": "eager", "models": ["a", "b"], "fps": 160.0, "ok": True,
         "repetition": 2, "consumers": []},
    ]  # fmt: skip
    text = "\n".join(run_all.summary(recs + more, ["a", "b"], "on"))
    assert (
        "gpipe fan-out 160.0 / slowest model alone 150.0 = 1.07 (medians of 3 repetitions) "
        "(target >= 0.9) PASS" in text
    ), text
    assert "(repetition 3)" in text


def test_latency_statistics():
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 99) == 4
    s = latency_summary([1000 * i for i in range(1, 101)])
    assert s == {"n": 100, "p50_us": 50.0, "p99_us": 99.0, "max_us": 100.0, "mean_us": 50.5}
    assert latency_summary([]) is None


# ---------------------------------------------------------------------------------------
# CUDA: graph mode (skipped without a GPU)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("latency", [False, True])
def test_cuda_gpipe_graph_per_slot(tmp_path, latency):
    cfg = config(tmp_path, "cuda")
    rate = 200.0 if latency else 0.0
    rec = run_all.run_gpipe(
        cfg, "graph", ["tiny", "tiny", "empty"], rate=rate, frames=40, latency=latency
    )
    assert rec.get("ok"), f"{rec}\n{logs(tmp_path)}"
    assert_every_frame(rec, 3, latency=latency, timed=40)
    for c in rec["consumers"]:
        assert c["graphs"] == (SLOTS if c["model"] == "tiny" else 0), c
    assert_tiny_outputs(rec, expected_outputs(WARMUP + 40, "cuda"), agree=0.9)


@cuda
def test_cuda_mp_queue_graph(tmp_path):
    recs = run_all.run_baseline(
        config(tmp_path, "cuda"),
        ["mp-queue", "--models", "tiny,empty", "--mode", "graph", "--frames", "40", "--check"],
        "mp",
        timeout=90,
    )
    assert len(recs) == 1 and recs[0].get("ok"), f"{recs}\n{logs(tmp_path)}"
    assert_every_frame(recs[0], 2, latency=False, timed=40)
    assert_tiny_outputs(recs[0], expected_outputs(WARMUP + 40, "cuda"), agree=0.9)


@cuda
def test_cuda_inproc_graph_and_streams(tmp_path):
    recs = run_all.run_baseline(
        config(tmp_path, "cuda"),
        ["inproc", "--models", "tiny,tiny", "--modes", "eager,graph", "--frames", "40"],
        "inproc",
    )
    runs = [(r["run"], r["mode"]) for r in recs]
    assert runs == [
        ("solo", "eager"), ("solo", "eager"), ("sequential", "eager"),
        ("solo", "graph"), ("solo", "graph"), ("sequential", "graph"), ("streams", "graph"),
    ], f"{recs}\n{logs(tmp_path)}"  # fmt: skip
    want = expected_outputs(WARMUP + 40, "cuda")
    for r in recs:
        assert r["ok"] and r["timed"] == 40, r
        for c in r["consumers"]:
            same = sum(g == w for g, w in zip(c["outputs_head"], want))
            assert same >= 0.9 * len(c["outputs_head"]), (r, want)


def test_latency_floor_measures_every_reader(tmp_path):
    """apps/fanout/latency_floor.py: readers asleep in a pipe read each report their
    latencies (a spinning reader would need a core of its own, which CI may not have)."""
    import subprocess

    out = subprocess.run(
        [sys.executable, str(APP / "latency_floor.py"), "--readers", "2", "--rate", "100"]
        + ["--seconds", "0.3", "--wait", "sleep"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["run"] == "latency-floor" and rec["wait"] == "sleep" and rec["stamps"] == 30
    assert [r["reader"] for r in rec["results"]] == [0, 1]
    for r in rec["results"]:
        assert 1 <= r["n"] <= 30, r
        assert 0 < r["p50_us"] <= r["p99_us"] <= r["max_us"] < 5e6, r
    bad = subprocess.run(
        [sys.executable, str(APP / "latency_floor.py"), "--readers", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "must be positive" in bad.stderr

"""The data loader application (apps/loader) on the host backend, at tiny sizes.

The GPU runs (apps/loader/gpu.sh) measure it; these check that it is right: the data
set maker, the batched augmentation (shape, dtype, layout, normalisation, flip, crop boxes),
the epoch plan, and the real programs as processes — a producer feeding a trainer (epoch
marks, every batch once, in order), one producer feeding two trainers that take turns (the
same count each), and two DDP ranks (gloo) each fed by its own producer's shard.

Every child process runs under a timeout, and a watchdog ends a hung test with a traceback.
"""

from __future__ import annotations

import faulthandler
import io
import json
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")
pytest.importorskip("PIL")
pytest.importorskip("gpipe")

LOADER = Path(__file__).resolve().parents[1] / "loader"
sys.path.insert(0, str(LOADER))

import gpipe.torch  # noqa: E402
import gpu_decode  # noqa: E402
import make_dataset  # noqa: E402
import pack_dataset  # noqa: E402

WATCHDOG_S = 90
CHILD_TIMEOUT_S = 60
SIZE = 32  # crop size of the process tests
IMAGES = 24


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("loader") / "data")
    make_dataset.make_dataset(root, count=IMAGES, classes=3, min_size=(40, 40), max_size=(64, 64),
                              processes=1, quiet=True)
    return root


@pytest.fixture(scope="module")
def pack(data) -> str:
    return pack_dataset.pack(data, quiet=True)["path"]


SOCK_DIR = Path("/tmp") / f"ld-{os.getpid()}"  # Unix socket paths are limited to 107 bytes


@pytest.fixture(scope="module", autouse=True)
def sock_dir():
    SOCK_DIR.mkdir(exist_ok=True)
    yield
    shutil.rmtree(SOCK_DIR, ignore_errors=True)


def sock() -> str:
    return str(SOCK_DIR / f"{uuid.uuid4().hex[:8]}.sock")


class Proc:
    """A child Python process running one of the loader's scripts, in its own session."""

    def __init__(self, script: str, *args: str):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen(
            [sys.executable, str(LOADER / script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True, env=env,
        )

    def result(self) -> dict:
        try:
            out, err = self.p.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            out, err = self.p.communicate()
            pytest.fail(f"timed out after {CHILD_TIMEOUT_S} s: {self.p.args}\n{err[-3000:]}")
        assert self.p.returncode == 0, f"{self.p.args} exited {self.p.returncode}\n{err[-3000:]}"
        return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()


@pytest.fixture
def procs():
    started: list[Proc] = []

    def start(script: str, *args: str) -> Proc:
        p = Proc(script, *args)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


# ---- the data set ----------------------------------------------------------------------------


def test_dataset_layout_sizes_and_determinism(data, tmp_path):
    from PIL import Image

    folder = gpu_decode.ImageFolder(data)
    assert folder.classes == ["class_000", "class_001", "class_002"]
    assert len(folder) == IMAGES
    assert folder.labels.tolist() == sorted(i % 3 for i in range(IMAGES))
    for path in folder.paths[:6]:
        with Image.open(path) as img:
            assert img.format == "JPEG" and img.mode == "RGB"
            assert 40 <= img.width <= 64 and 40 <= img.height <= 64
            assert not img.info.get("progressive")  # baseline JPEG: the hardware decoder's kind
    record = json.loads(Path(data, "dataset.json").read_text())
    assert record["params"]["count"] == IMAGES and record["bytes"] > 0
    # The same arguments give the same bytes, whatever the number of processes.
    other = str(tmp_path / "again")
    make_dataset.make_dataset(other, count=6, classes=3, min_size=(40, 40), max_size=(64, 64), processes=2, quiet=True)
    for i in range(6):
        rel = os.path.relpath(make_dataset.image_path(data, i, 3), data)
        assert Path(data, rel).read_bytes() == Path(other, rel).read_bytes()
    # A second run with the same arguments finds the set made and writes nothing.
    before = os.path.getmtime(make_dataset.image_path(other, 0, 3))
    make_dataset.make_dataset(other, count=6, classes=3, min_size=(40, 40), max_size=(64, 64), processes=2, quiet=True)
    assert os.path.getmtime(make_dataset.image_path(other, 0, 3)) == before


# ---- the batched augmentation ----------------------------------------------------------------


def test_augment_shape_dtype_layout_and_normalisation():
    mean = torch.tensor(gpu_decode.IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(gpu_decode.IMAGENET_STD).view(3, 1, 1)
    colours = [torch.tensor([10, 128, 250]), torch.tensor([0, 0, 0]), torch.tensor([255, 60, 7])]
    sizes = [(40, 50), (64, 33), (37, 64)]
    # Flat images: any crop of one is the colour itself, so the output is known exactly.
    images = [c.view(3, 1, 1).expand(3, h, w).to(torch.uint8).contiguous() for c, (h, w) in zip(colours, sizes)]
    out = gpu_decode.Augment(16, "cpu", seed=1)(images)
    assert out.shape == (3, 3, 16, 16) and out.dtype == torch.float16
    assert out.is_contiguous(memory_format=torch.channels_last)
    for i, c in enumerate(colours):
        want = ((c.view(3, 1, 1) / 255.0 - mean) / std).expand(3, 16, 16)
        assert torch.allclose(out[i].float(), want, atol=1e-2), (i, out[i, :, 0, 0], want[:, 0, 0])


def test_augment_writes_into_a_given_tensor_and_flips():
    # A horizontal ramp, cropped as a whole (scale 1, the image's own ratio): no flip keeps it
    # rising from left to right, a flip makes it fall.
    ramp = torch.arange(60, dtype=torch.float32).mul(4).view(1, 1, 60).expand(3, 45, 60).to(torch.uint8).contiguous()
    for p, rising in ((0.0, True), (1.0, False)):
        aug = gpu_decode.Augment(20, "cpu", scale=(1.0, 1.0), ratio=(60 / 45, 60 / 45), flip_p=p)
        out = torch.empty(2, 3, 20, 20, dtype=torch.float16, memory_format=torch.channels_last)
        got = aug([ramp, ramp], out=out)
        assert got is out
        row = out[0, 0, 10].float()
        assert bool((row[1:] > row[:-1]).all()) == rising
        assert bool((row[1:] < row[:-1]).all()) == (not rising)
        # The whole ramp: its ends map to the first and last pixels' values.
        first, last = (0 / 255 - 0.485) / 0.229, (236 / 255 - 0.485) / 0.229
        ends = (row[0].item(), row[-1].item()) if rising else (row[-1].item(), row[0].item())
        assert abs(ends[0] - first) < 0.25 and abs(ends[1] - last) < 0.25
    with pytest.raises(ValueError):
        gpu_decode.Augment(20, "cpu")([ramp], out=torch.empty(1, 3, 20, 20))  # float32: refused


def test_crop_boxes_stay_inside_and_follow_scale_and_ratio():
    aug = gpu_decode.Augment(224, "cpu", seed=3)
    g = torch.Generator().manual_seed(0)
    h = torch.randint(300, 481, (4000,), generator=g)  # the data set's sizes
    w = torch.randint(400, 641, (4000,), generator=g)
    w[:50] = 1000  # very wide images: no try fits the ratio; the clamped centre crop is taken
    h[:50] = 30
    boxes = aug.boxes(h, w).double()
    x1, y1, x2, y2 = boxes.unbind(1)
    cw, ch = x2 - x1 + 1, y2 - y1 + 1
    assert (x1 >= 0).all() and (y1 >= 0).all()
    assert (x2 <= w - 1).all() and (y2 <= h - 1).all()
    assert (x1 == x1.round()).all() and (cw >= 1).all() and (ch >= 1).all()
    frac = cw * ch / (h * w)
    ratio = cw / ch
    normal = slice(50, None)
    # Rounding to whole pixels moves scale and ratio a little.
    assert (frac[normal] > 0.075).all() and (frac[normal] <= 1.0 + 1e-9).all()
    assert ((ratio[normal] > 0.73) & (ratio[normal] < 1.37)).all()
    assert (ratio[:50] - 4 / 3).abs().max() < 0.05  # fallback: ratio clamped to 4/3
    # The same distribution as torchvision's RandomResizedCrop (rejection makes big crops rarer).
    from torchvision.transforms import RandomResizedCrop

    torch.manual_seed(0)
    ref = []
    for hh, ww in zip(h[normal].tolist(), w[normal].tolist()):
        _, _, rh, rw = RandomResizedCrop.get_params(torch.empty(1, hh, ww), (0.08, 1.0), (3 / 4, 4 / 3))
        ref.append(rh * rw / (hh * ww))
    assert frac[normal].mean().item() == pytest.approx(sum(ref) / len(ref), abs=0.02)


def test_epoch_plan_shards_partition_each_epoch():
    plans = [gpu_decode.EpochPlan(103, 5, shard=k, shards=3, seed=7) for k in range(3)]
    assert {p.batches_per_epoch for p in plans} == {6}  # 103 // 3 = 34 images -> 6 whole batches
    for epoch in (0, 1):
        parts = [p.epoch(epoch) for p in plans]
        assert all(part.shape == (6, 5) for part in parts)
        every = torch.cat([part.flatten() for part in parts])
        assert every.unique().numel() == every.numel()  # no image in two shards
    assert not torch.equal(plans[0].epoch(0), plans[0].epoch(1))  # reshuffled each epoch
    assert torch.equal(plans[0].epoch(1), gpu_decode.EpochPlan(103, 5, shard=0, shards=3, seed=7).epoch(1))
    assert gpu_decode.EpochPlan(100, 7, multiple=4).batches_per_epoch == 12  # 14 rounded down
    with pytest.raises(ValueError):
        gpu_decode.EpochPlan(10, 20)


def test_decoded_batches_read_decode_in_order(data):
    folder = gpu_decode.ImageFolder(data)
    plan = gpu_decode.EpochPlan(len(folder), 5)
    with gpu_decode.DecodedBatches(folder, plan, "cpu", epochs=2, read_threads=2) as src:
        items = list(src)
    assert [(d.epoch, d.index, d.global_index) for d in items] == [(e, i, e * 4 + i) for e in (0, 1) for i in range(4)]
    for d in items:
        order = plan.epoch(d.epoch)[d.index]
        assert d.labels.tolist() == folder.labels[order].tolist()
        assert all(im.dtype == torch.uint8 and im.shape[0] == 3 for im in d.images)


# ---- packs ------------------------------------------------------------------------------------


def test_a_pack_holds_the_folders_images_labels_and_classes(data, pack):
    folder, packed = gpu_decode.ImageFolder(data), gpu_decode.open_images(pack)
    assert isinstance(packed, gpu_decode.PackedImages) and packed.kind == "pack"
    assert isinstance(gpu_decode.open_images(data), gpu_decode.ImageFolder)
    assert packed.classes == folder.classes and packed.labels.tolist() == folder.labels.tolist()
    assert len(packed) == len(folder) == IMAGES
    for i in range(IMAGES):
        view = packed.read(i)
        assert view.dtype == torch.uint8 and view.dim() == 1 and view.is_contiguous()
        assert bytes(view.numpy()) == Path(folder.paths[i]).read_bytes()
        assert packed.pil_source(i).read() == Path(folder.paths[i]).read_bytes()
    assert packed.read(0).data_ptr() == packed.data.data_ptr()  # a view of the pack, not a copy
    assert pack_dataset.pack(data, quiet=True).get("reused") is True


def test_a_pack_is_made_again_when_its_folder_changes(tmp_path):
    root = str(tmp_path / "d")
    make_dataset.make_dataset(root, count=6, classes=2, min_size=(24, 24), max_size=(32, 32), processes=1, quiet=True)
    first = pack_dataset.pack(root, quiet=True)
    assert first["images"] == 6 and "reused" not in first
    os.unlink(make_dataset.image_path(root, 5, 2))
    second = pack_dataset.pack(root, quiet=True)
    assert second["images"] == 5 and "reused" not in second
    assert len(gpu_decode.PackedImages(second["path"])) == 5
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]  # no temporary file left


def _forge(path: Path, index: object, data: bytes, magic: bytes = gpu_decode.PACK_MAGIC) -> str:
    blob = json.dumps(index).encode()
    path.write_bytes(magic + len(blob).to_bytes(8, "little") + blob + data)
    return str(path)


@pytest.mark.parametrize("case, needle", [
    ("magic", "not an image pack"),
    ("empty", "not an image pack"),
    ("truncated index", "truncated"),
    ("bad json", "unreadable index"),
    ("version", "pack version 2"),
    ("missing field", "lacks one of"),
    ("counts differ", "2 labels, 1 offsets"),
    ("label", "label 7 is not one of the 2 classes"),
    ("outside", "outside the 10 data bytes"),
    ("negative", "outside the 10 data bytes"),
    ("not int", "must be integers"),
])
def test_a_damaged_pack_is_refused_with_what_is_wrong(tmp_path, case, needle):
    good = {"version": 1, "classes": ["a", "b"], "labels": [0, 1], "offsets": [0, 5], "lengths": [5, 5]}
    f = tmp_path / "x.pack"
    if case == "magic":
        path = _forge(f, good, b"0" * 10, magic=b"NOTAPACK")
    elif case == "empty":
        f.write_bytes(b"")
        path = str(f)
    elif case == "truncated index":
        f.write_bytes(gpu_decode.PACK_MAGIC + (1000).to_bytes(8, "little") + b"{}")
        path = str(f)
    elif case == "bad json":
        f.write_bytes(gpu_decode.PACK_MAGIC + (3).to_bytes(8, "little") + b"{x}" + b"0" * 10)
        path = str(f)
    else:
        index = dict(good)
        if case == "version":
            index["version"] = 2
        elif case == "missing field":
            del index["lengths"]
        elif case == "counts differ":
            index["offsets"] = [0]
        elif case == "label":
            index["labels"] = [0, 7]
        elif case == "outside":
            index["lengths"] = [5, 6]
        elif case == "negative":
            index["offsets"] = [0, -1]
        elif case == "not int":
            index["lengths"] = [5, 5.0]
        path = _forge(f, index, b"0" * 10)
    with pytest.raises(ValueError, match=needle):
        gpu_decode.open_images(path)


def test_open_images_names_a_missing_data_set(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder or pack"):
        gpu_decode.open_images(str(tmp_path / "nothing"))


def test_decoded_batches_from_a_pack_match_the_folder(data, pack):
    plan = gpu_decode.EpochPlan(IMAGES, 6)
    got = {}
    for src in (data, pack):
        with gpu_decode.DecodedBatches(gpu_decode.open_images(src), plan, "cpu", epochs=1, read_threads=2) as it:
            got[src] = list(it)
    assert len(got[data]) == len(got[pack]) == IMAGES // 6
    for a, b in zip(got[data], got[pack]):
        assert a.labels.tolist() == b.labels.tolist()
        assert all(torch.equal(x, y) for x, y in zip(a.images, b.images))


def test_the_scaling_probe_runs_each_stage_in_several_processes(data, pack, tmp_path):
    out = tmp_path / "scaling.jsonl"
    cmd = [sys.executable, str(LOADER / "scaling.py"), data, pack, "--cpu", "--procs", "2", "--seconds", "0.3",
           "--batch", "4", "--threads", "2", "--size", str(SIZE), "--stages", "read,decode,pipeline",
           "--json-out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert recs[0]["what"] == "scaling-host" and recs[0]["devices"] == ["cpu"]
    points = recs[1:]
    assert [(p["source"], p["stage"], p["procs"]) for p in points] == [
        (src, stage, 2) for src in ("folder", "pack") for stage in ("read", "decode", "pipeline")]
    for p in points:
        assert "error" not in p, p
        assert len(p["per_process"]) == p["procs"] and sorted(r["index"] for r in p["per_process"]) == list(
            range(p["procs"]))
        assert all(r["batches"] > 0 and r["images"] == 4 * r["batches"] for r in p["per_process"])
        assert p["images_per_s"] == pytest.approx(sum(r["images_per_s"] for r in p["per_process"]), abs=0.2)
    assert "stage" in r.stderr and "images/s" in r.stderr  # the table
    assert all("wait_ms_per_batch" in w and "decode_ms_per_batch" in w
               for p in points if p["stage"] == "pipeline" for w in p["per_process"])


def test_the_scaling_probe_profiles_worker_zero(pack, tmp_path):
    prof = tmp_path / "prof"
    cmd = [sys.executable, str(LOADER / "scaling.py"), pack, "--cpu", "--procs", "2", "--seconds", "0.3",
           "--batch", "4", "--threads", "2", "--size", str(SIZE), "--stages", "pipeline", "--side-stream",
           "--profile", str(prof)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    point = json.loads([x for x in r.stdout.splitlines() if '"stage"' in x][-1])
    assert point["side_stream"] is True and point["profiled"] is True
    workers = sorted(point["per_process"], key=lambda w: w["index"])
    assert [w.get("profile") is not None for w in workers] == [True, False]  # worker 0 only
    table = Path(workers[0]["profile"])
    assert table.parent == prof and "roi_align" in table.read_text()


# ---- the programs, as processes --------------------------------------------------------------


def producer_args(data: str, socket: str, *extra: str, batch: int = 4) -> list[str]:
    return ["--data", data, "--socket", socket, "--backend", "host", "--batch", str(batch), "--size", str(SIZE),
            "--slots", "3", "--read-threads", "2", "--warmup", "0", *extra]


@pytest.mark.parametrize("source", ["folder", "pack"])
def test_producer_feeds_a_trainer_with_epoch_marks(data, pack, procs, source):
    s = sock()
    side = ["--side-stream"] if source == "pack" else []  # on the CPU it changes nothing but the record
    prod = procs("producer.py", *producer_args(data if source == "folder" else pack, s, "--epochs", "2", *side))
    train = procs("train.py", "--socket", s, "--model", "resnet18", "--steps", "0", "--warmup", "1")
    t, p = train.result(), prod.result()
    per_epoch = IMAGES // 4
    assert p["end"] == "done" and p["batches"] == 2 * per_epoch and p["batches_per_epoch"] == per_epoch
    assert p["source"] == source and p["side_stream"] is (source == "pack") and p["torch_threads"] == 1
    assert t["received"] == 2 * per_epoch and t["skipped"] == 0
    assert t["globals"] == list(range(2 * per_epoch)) and t["out_of_order"] == 0
    assert t["epochs"] == {"0": per_epoch, "1": per_epoch}  # batches seen per epoch, warm-up included
    assert t["steps"] == 2 * per_epoch - 1 and t["images_per_s"] > 0
    assert t["enforced_read_only"] is True
    assert math.isfinite(t["loss"])
    assert len(t["timeline"]["wait_ms"]) == t["steps"]


def test_one_producer_two_trainers_taking_turns(data, procs):
    s = sock()
    # Batches of 3: 8 per epoch, a multiple of 2, so both trainers get the same count.
    args = producer_args(data, s, "--epochs", "2", "--consumers", "2", "--multiple", "2", batch=3)
    prod = procs("producer.py", *args)
    trainers = [procs("train.py", "--socket", s, "--model", "none", "--steps", "0", "--warmup", "0", "--take", f"{r}/2")
                for r in range(2)]
    ts = [t.result() for t in trainers]
    p = prod.result()
    assert p["batches"] == 16 and p["end"] == "done"
    for r, t in enumerate(ts):
        assert t["received"] == 16 and t["kept"] == 8 and t["skipped"] == 8
        assert t["globals"] == list(range(r, 16, 2))
        assert t["epochs"] == {"0": 4, "1": 4}


def test_the_producer_waits_for_a_trainer_slow_with_its_last_batch(data, procs):
    """A DDP rank may sit on its last batch while it waits for a slower rank: the producer, done
    publishing, must wait for it, not take the batch back after gpipe's default 5 s drain."""
    import time

    import train

    s = sock()
    prod = procs("producer.py", *producer_args(data, s, "--epochs", "1"))
    c = train.attach(s, CHILD_TIMEOUT_S)
    per_epoch = IMAGES // 4
    with c:
        for _ in range(per_epoch - 1):
            c.recv(timeout=CHILD_TIMEOUT_S).release()
        last = c.recv(timeout=CHILD_TIMEOUT_S)
        time.sleep(6.0)  # longer than the 5 s the producer used to wait
        last.release()  # raised Detached when the producer had taken it back
    p = prod.result()
    assert p["end"] == "done" and p["batches"] == per_epoch
    assert p["counters"]["detached"] == 0, p["counters"]


def test_two_ddp_ranks_each_fed_by_its_own_producer(data, procs):
    socks = [sock(), sock()]
    pg = f"file://{SOCK_DIR / uuid.uuid4().hex[:8]}"
    prods = [procs("producer.py", *producer_args(data, socks[r], "--epochs", "1", "--shard", f"{r}/2"))
             for r in range(2)]
    trainers = [procs("train.py", "--socket", socks[r], "--model", "resnet18", "--steps", "0", "--warmup", "1",
                      "--world-size", "2", "--rank", str(r), "--dist-url", pg) for r in range(2)]
    ts = [t.result() for t in trainers]
    ps = [p.result() for p in prods]
    per_rank = IMAGES // 2 // 4
    for r in range(2):
        assert ps[r]["batches"] == per_rank and ps[r]["shard"] == [r, 2]
        assert ts[r]["received"] == per_rank and ts[r]["world_size"] == 2 and ts[r]["rank"] == r
        assert ts[r]["steps"] == per_rank - 1  # the same count on every rank: all-reduce never waits
        assert math.isfinite(ts[r]["loss"])


def test_one_trainer_reads_two_decode_processes_in_turn(data, procs):
    socks = [sock(), sock()]
    prods = [procs("producer.py", *producer_args(data, socks[d], "--epochs", "2", "--shard", f"{d}/2"))
             for d in range(2)]
    train = procs("train.py", "--socket", ",".join(socks), "--model", "resnet18", "--steps", "0", "--warmup", "1")
    t = train.result()
    ps = [p.result() for p in prods]
    per_ring = IMAGES // 2 // 4  # each producer's shard: 3 batches per epoch
    for d in range(2):
        assert ps[d]["end"] == "done" and ps[d]["batches"] == 2 * per_ring and ps[d]["shard"] == [d, 2]
    assert t["rings"] == 2 and t["received"] == 4 * per_ring and t["out_of_order"] == 0
    # Every batch of both rings, each ring's in its own order, taken one from each in turn.
    assert t["per_ring"] == [list(range(2 * per_ring))] * 2
    assert t["globals"] == [g for g in range(2 * per_ring) for _ in range(2)]
    assert t["epochs"] == {"0": 2 * per_ring, "1": 2 * per_ring}
    assert t["steps"] == 4 * per_ring - 1 and math.isfinite(t["loss"])


def test_a_trainer_refuses_rings_split_by_take(procs):
    train = procs("train.py", "--socket", f"{sock()},{sock()}", "--take", "0/2", "--attach-timeout", "1")
    _, err = train.p.communicate(timeout=CHILD_TIMEOUT_S)
    assert train.p.returncode == 2 and "with several rings give each trainer its own" in err


@pytest.mark.parametrize("source", ["folder", "pack"])
def test_baselines_run_on_the_cpu(data, pack, procs, source):
    common = ["--model", "resnet18", "--device", "cpu", "--batch", "4", "--size", str(SIZE), "--steps", "2",
              "--warmup", "1", "--workers", "1", "--read-threads", "2", "--classes", "3"]
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import baselines\n"
        "for mode in ('ceiling', 'inprocess', 'dataloader'):\n"
        "    baselines.main([mode, '--data', sys.argv[2], *sys.argv[3:]])\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(LOADER), data if source == "folder" else pack, *common],
        capture_output=True, text=True,
        timeout=CHILD_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in recs] == ["ceiling", "inprocess", "dataloader"]
    for r in recs:
        assert r["steps"] == 2 and r["images_per_s"] > 0 and math.isfinite(r["loss"])
        assert len(r["timeline"]["step_ms"]) == 2
    assert [r.get("source") for r in recs] == [None, source, source]


@pytest.mark.parametrize("source", ["folder", "pack"])
def test_the_library_loader_feeds_a_trainer(data, pack, procs, source):
    t = procs("loader_lib.py", "--data", data if source == "folder" else pack, "--device", "cpu",
              "--model", "resnet18", "--batch", "4", "--size", str(SIZE), "--steps", "3",
              "--warmup", "1", "--workers", "2").result()
    assert t["mode"] == "loader" and t["source"] == source and t["workers"] == 2
    assert t["steps"] == 3 and t["images_per_s"] > 0 and math.isfinite(t["loss"])
    assert t["batches_per_epoch"] == IMAGES // 4 and "as asked" in t["workers_why"]
    assert t["settled"] is True  # a fixed worker count is settled from the start


def test_the_library_loader_feeds_two_ddp_ranks(data, procs):
    pg = f"file://{SOCK_DIR / uuid.uuid4().hex[:8]}"
    ranks = [procs("loader_lib.py", "--data", data, "--device", "cpu", "--model", "resnet18",
                   "--batch", "4", "--size", str(SIZE), "--steps", "2", "--warmup", "1",
                   "--workers", "auto", "--max-workers", "2", "--world-size", "2", "--rank", str(r),
                   "--dist-url", pg) for r in range(2)]
    ts = [r.result() for r in ranks]
    for r, t in enumerate(ts):
        assert t["rank"] == r and t["world_size"] == 2 and t["steps"] == 2
        assert t["batches_per_epoch"] == IMAGES // 2 // 4 and 1 <= t["workers"] <= 2
        assert t["workers_why"].startswith("auto"), t["workers_why"]
        # timed once every rank's auto settled, or at the settle cap (then the record says so)
        assert t["settled"] is True or t["settle_steps"] == 600, t


def test_the_summary_says_when_a_loader_run_was_timed_before_auto_settled(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("loader_run_all", LOADER / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    base = {"run": "r", "model": "resnet50", "world_size": 2, "batch": 256, "gpu": "G", "mps": False}
    recs = [
        {**base, "config": "loader", "images_per_s": 7000.0, "workers": 8, "per_rank_workers": [8, 15],
         "workers_why": "auto: 8 workers", "settle_steps": 600, "settled": False,
         "per_rank_images_per_s": [3500.0, 3500.0], "wait_fraction": 0.01, "gpu_util": 99.0},
        {**base, "config": "ceiling", "images_per_s": 7700.0, "wait_fraction": 0.0, "gpu_util": 100.0},
    ]
    path = tmp_path / "loader.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = run_all.summarize(str(path))
    row = next(line for line in text.splitlines() if " loader " in line)
    assert "timed unsettled: auto was still at work at the 600-step cap" in row, text
    assert "8/15 decode workers" in row, text
    recs[0].update(settled=True, per_rank_workers=[8, 8])
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    row = next(line for line in run_all.summarize(str(path)).splitlines() if " loader " in line)
    assert "unsettled" not in row and "8 decode workers" in row, row


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not torch.cuda.is_available() or not _has_cupy(), reason="needs a CUDA GPU and CuPy")
def test_the_fused_augment_kernel_computes_what_the_torch_path_does():
    """fused_augment.py's one kernel against Augment's torch path (roi_align, flip, addcmul),
    same boxes and flips: images of many sizes, crops that shrink and that enlarge."""
    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(5)
    sizes = [(375, 500), (500, 375), (64, 80), (224, 224), (900, 1200), (33, 47), (480, 640), (300, 301)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=gen).to(dev) for h, w in sizes * 4]
    fused = gpu_decode.Augment(224, dev, seed=11)
    plain = gpu_decode.Augment(224, dev, seed=11)
    assert fused.kernel == "fused"
    plain.kernel = "torch"
    a, b = fused(images), plain(images)
    torch.cuda.synchronize(dev)
    assert a.shape == b.shape == (32, 3, 224, 224) and a.dtype == b.dtype == torch.float16
    assert a.is_contiguous(memory_format=torch.channels_last)
    diff = (a.float() - b.float()).abs()
    # float16 outputs in about [-2.2, 2.7]: a step of 2^-9 near 2, sums in another order
    assert diff.max().item() <= 1.6e-2, diff.max().item()
    assert diff.mean().item() <= 1e-3, diff.mean().item()
    out = torch.empty_like(a)
    assert fused(images, out=out) is out  # in place (a gpipe slot), the next batch's crops
    # images laid out H x W x 3 (as a CPU JPEG decoder writes them): the same crops
    hwc = [im.permute(1, 2, 0).contiguous().permute(2, 0, 1) for im in images]
    again = gpu_decode.Augment(224, dev, seed=11)
    assert torch.equal(again(hwc), a)
    with pytest.raises(ValueError, match="laid out as 3 x H x W or H x W x 3"):
        again([images[0][:, :, ::2]])
    # the same images packed one after the other, H x W x 3, read by the table (host decode's
    # Upload): the same crops, from one tensor and no view per image
    parts = [im.permute(1, 2, 0).reshape(-1) for im in images]
    offsets = torch.tensor([0] + [p.numel() for p in parts]).cumsum(0)[:-1]
    table = torch.stack([offsets, torch.tensor([h for h, _ in sizes * 4]), torch.tensor([w for _, w in sizes * 4])], 1)
    packed = gpu_decode.Augment(224, dev, seed=11)
    boxes = packed.boxes(table[:, 1], table[:, 2])
    assert torch.equal(packed.apply_packed(torch.cat(parts), table, boxes, packed.flips(len(parts))), a)
    bad = table.clone()
    bad[-1, 0] += 1  # its last image runs one byte past the end
    with pytest.raises(ValueError, match="do not all lie in the"):
        packed.apply_packed(torch.cat(parts), bad, boxes, packed.flips(len(parts)))


# ---- host decode: CPU decode in the workers, augmentation in the trainer's process ---------


def _jpegs(data: str, n: int) -> list:
    images = gpu_decode.open_images(data)
    return [(images.read(i), int(images.labels[i])) for i in range(n)]


def test_host_decode_packs_a_batch_and_upload_augments_what_augment_would(data):
    import host_decode

    samples = _jpegs(data, 6)
    buf, table, labels = host_decode.HostDecode(6, (64, 64))(samples, torch.device("cpu"))
    # the used part only, within the room the Loader's slot_bytes gives it
    assert buf.dtype == torch.uint8 and buf.numel() == sum(3 * h * w for _, h, w in table.tolist())
    assert host_decode.HostDecode(6, (64, 64)).slot_bytes >= 6 * 3 * 64 * 64 + 6 * 4 * 8
    assert labels.tolist() == [s[1] for s in samples]
    # each image where its row says, H x W x 3, as torchvision decodes it on the CPU, and
    # within a level or two of what Pillow decodes
    import numpy
    from PIL import Image

    decoded = gpu_decode.decode([s[0] for s in samples], torch.device("cpu"))
    for (o, h, w), im, (data, _) in zip(table.tolist(), decoded, samples):
        assert (h, w) == tuple(im.shape[1:])
        got = buf[o : o + 3 * h * w].view(h, w, 3)
        assert torch.equal(got.permute(2, 0, 1), im)
        with Image.open(io.BytesIO(data.numpy().tobytes())) as pil:
            ref = torch.from_numpy(numpy.array(pil.convert("RGB")))
        assert (got.int() - ref.int()).abs().max().item() <= 2
    # the trainer's side, on the CPU: Augment's torch path with the same draws
    up = host_decode.Upload(iter([(buf, table, labels, {"epoch": 0})]), torch.device("cpu"), SIZE, seed=3)
    out, lab, info = next(up)
    ref_aug = gpu_decode.Augment(SIZE, "cpu", seed=3)
    images = [buf[o : o + 3 * h * w].view(h, w, 3).permute(2, 0, 1).contiguous() for o, h, w in table.tolist()]
    ref = ref_aug(images)
    assert out.shape == (6, 3, SIZE, SIZE) and out.dtype == torch.float16
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, ref) and lab.tolist() == labels.tolist() and info == {"epoch": 0}


def test_host_decode_refuses_an_image_larger_than_its_buffer(data):
    import host_decode

    with pytest.raises(ValueError, match="larger than the 32x32"):
        host_decode.HostDecode(2, (32, 32))(_jpegs(data, 2), torch.device("cpu"))


def test_the_library_loader_feeds_a_trainer_decoding_on_the_host(data, procs):
    t = procs("loader_lib.py", "--data", data, "--device", "cpu", "--model", "resnet18",
              "--batch", "4", "--size", str(SIZE), "--steps", "3", "--warmup", "1",
              "--workers", "2", "--host-decode").result()
    assert t["mode"] == "loader" and t["host_decode"] and t["workers"] == 2
    assert t["steps"] == 3 and t["images_per_s"] > 0 and math.isfinite(t["loss"])



class MadeElsewhere:
    """A stand-in for the GPU decoder of mixed_decode: (images, labels) as an augmented batch
    would be, its images filled with the process id that made it; slow enough (0.3 s a batch)
    that the other workers, which start later, make batches too."""

    def __call__(self, samples: list, device: torch.device) -> tuple:
        time.sleep(0.3)
        images = torch.full((len(samples), 3, SIZE, SIZE), float(os.getpid() % 2048), dtype=torch.float16)
        return images.to(device), torch.tensor([s[1] for s in samples], dtype=torch.int64).to(device)

    def batch_bytes(self, batch: int) -> int:
        import loader_lib

        return loader_lib.DecodeAugment(SIZE, 0).batch_bytes(batch)


def _decode_once_and_end(mixed, samples: list) -> None:
    mixed(samples, torch.device("cpu"))


def _decode_once_and_hang(mixed, samples: list) -> None:
    mixed(samples, torch.device("cpu"))
    time.sleep(3600)


def test_mixed_decode_sizes_slots_for_either_decoder_and_a_gpu_place_outlives_no_worker(data):
    import host_decode
    import loader_lib
    import mixed_decode

    # images of 8 x 8 leave less room than a batch of 32 x 32 float16 crops needs
    small = mixed_decode.MixedDecode(1, torch.device("cpu"), MadeElsewhere(), host_decode.HostDecode(2, (8, 8)))
    crops = host_decode.room(2 * 3 * SIZE * SIZE * 2, 2 * 8)
    assert small.slot_bytes == crops == loader_lib.DecodeAugment(SIZE, 0).batch_bytes(2) > small.on_host.slot_bytes
    big = mixed_decode.MixedDecode(1, torch.device("cpu"), MadeElsewhere(), host_decode.HostDecode(2, (640, 480)))
    assert big.slot_bytes == big.on_host.slot_bytes > crops
    # a GPU place is free again once its process has ended, or been killed
    samples = _jpegs(data, 2)
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_decode_once_and_end, args=(big, samples))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert big.gpu_workers_now == 0, "the GPU place of a process that ended is still taken"
    p = ctx.Process(target=_decode_once_and_hang, args=(big, samples), daemon=True)
    p.start()
    deadline = time.monotonic() + 60
    while big.gpu_workers_now == 0:
        assert time.monotonic() < deadline and p.is_alive(), "the process took no GPU place"
        time.sleep(0.05)
    big(samples, torch.device("cpu"))  # the one place is held: this process decodes on the host
    assert big.role == "host" and big.gpu_workers_now == 1
    p.kill()
    p.join(10)
    assert big.gpu_workers_now == 0, "the GPU place of a killed process is still taken"
    big.role = None  # as a new worker: the free place goes to the next process that asks
    big(samples, torch.device("cpu"))
    assert big.role == "gpu" and big.gpu_workers_now == 1


def test_mixed_decode_gives_its_first_workers_the_gpu_decoder_and_upload_passes_their_batches(data):
    import host_decode
    import mixed_decode

    samples = _jpegs(data, 8)
    mixed = mixed_decode.MixedDecode(1, torch.device("cpu"), MadeElsewhere(), host_decode.HostDecode(2, (640, 480)))
    assert mixed.slot_bytes == mixed.on_host.slot_bytes
    with gpipe.torch.Loader(samples * 4, mixed, batch_size=2, device="cpu", workers=3, shuffle=False,
                            epochs=1, slot_bytes=mixed.slot_bytes) as loader:

        def batches():
            for batch in loader:
                yield (*batch, {})

        up = host_decode.Upload(batches(), torch.device("cpu"), SIZE, seed=1)
        kinds, makers, labels = [], set(), []
        for images, lab, _ in up:
            assert images.shape == (2, 3, SIZE, SIZE) and images.dtype == torch.float16
            passed = bool(torch.all(images == images[0, 0, 0, 0]))  # as MadeElsewhere made it
            kinds.append(passed)
            if passed:
                makers.add(int(images[0, 0, 0, 0]))
            labels += lab.tolist()
    # one worker took the GPU decoder, the others the host one; batches in order either way
    assert len(makers) == 1 and any(kinds) and not all(kinds), kinds
    assert labels == [s[1] for s in samples] * 4



@pytest.mark.skipif(not torch.cuda.is_available() or not _has_cupy(), reason="needs a CUDA GPU and CuPy")
def test_mixed_decode_on_a_gpu_feeds_one_trainer_from_a_gpu_ring_and_page_locked_host_rings(data):
    """loader_lib.py --mixed's pieces: the first worker decodes on the GPU (its ring there,
    not page-locked), the others on the CPU into page-locked host rings; every batch reaches
    the trainer augmented on its GPU, in order."""
    import host_decode
    import loader_lib
    import mixed_decode

    dev = torch.device("cuda", 0)
    samples = _jpegs(data, 8)
    mixed = mixed_decode.MixedDecode(1, dev, loader_lib.DecodeAugment(SIZE, 5), host_decode.HostDecode(2, (64, 64)))
    with gpipe.torch.Loader(samples * 4, mixed, batch_size=2, device="cpu", workers=3, shuffle=False,
                            epochs=1, pin_memory=True, slot_bytes=mixed.slot_bytes) as loader:

        def batches():
            for batch in loader:
                yield (*batch, {})

        up = host_decode.Upload(batches(), dev, SIZE, seed=5)
        labels = []
        for images, lab, _ in up:
            assert images.device == dev and lab.device == dev and images.shape == (2, 3, SIZE, SIZE)
            labels += lab.tolist()
        up.close()
        on_gpu = [bool(r.flags.on_gpu.value) for r in loader._rings]
        # where the rings are, and which are page-locked, as the trainer attached to them
        rings = sorted((c.backend, c.pinned) for c in (r.consumer for r in loader._rings) if c is not None)
    assert on_gpu.count(True) == 1, on_gpu
    assert rings[0] == ("cuda", False) and all(r == ("host", True) for r in rings[1:]), rings
    assert up.pinned, "the host rings' slots are not page-locked"
    assert up.batches_uploaded >= 1  # host workers made some of the batches
    assert labels == [s[1] for s in samples] * 4

def test_mixed_decode_refuses_a_negative_count():
    import host_decode
    import mixed_decode

    with pytest.raises(ValueError, match="gpu_workers must be an int of 0 or more"):
        mixed_decode.MixedDecode(-1, torch.device("cuda", 0), MadeElsewhere(), host_decode.HostDecode(2, (8, 8)))

@pytest.mark.skipif(not torch.cuda.is_available() or not _has_cupy(), reason="needs a CUDA GPU and CuPy")
def test_host_decode_upload_on_a_gpu_matches_the_cpu_path_and_holds_a_batch_one_step(data):
    """Upload on CUDA, fed by a Loader of page-locked host rings (as loader_lib.py runs it):
    one copy of the packed images straight from the slot and the fused kernel, against the
    CPU path with the same draws; each batch is held until the next one is taken, then let
    go."""
    import weakref

    import host_decode

    dev = torch.device("cuda", 0)
    samples = _jpegs(data, 8)
    decode = host_decode.HostDecode(8, (64, 64))
    buf, table, labels = decode(samples, torch.device("cpu"))
    ref, _, _ = next(host_decode.Upload(iter([(buf, table, labels, {})]), torch.device("cpu"), SIZE, seed=9))
    refs = []
    with gpipe.torch.Loader(samples * 3, decode, batch_size=8, device="cpu", workers=1,
                            shuffle=False, epochs=1, pin_memory=True, slot_bytes=decode.slot_bytes) as loader:

        def batches():
            for b, t, lab in loader:
                refs.append(weakref.ref(b))
                yield b, t, lab, {}
                del b, t, lab

        up = host_decode.Upload(batches(), dev, SIZE, seed=9)
        out, lab, _ = next(up)
        assert up.pinned, "the Loader's pin_memory=True slots are not page-locked"
        assert refs[0]() is not None  # held while its copy may run
        next(up)
        assert refs[0]() is None and refs[1]() is not None  # let go once the next was taken
        up.close()
        assert up.held is None  # waited for and let go (the generator still holds its own)
        torch.cuda.synchronize(dev)
    assert lab.device == dev and lab.tolist() == labels.tolist()
    assert (out.float().cpu() - ref.float()).abs().max().item() <= 1.6e-2
    assert up.seconds["upload"] > 0 and up.batches_uploaded == 2

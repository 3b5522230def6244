"""gpipe weight updates: a trainer publishes a state dict with gpipe.torch.WeightPublisher
after each (simulated) optimizer step; receivers load it into their own tensors
(``load``) or read it in place (``inplace``), on the trainer's GPU or on others, reached
directly or through forwarders (``--shape``, gpipe.fanout_plan). One process is the trainer
and spawns the others; each update is timed from the trainer's ``publish()`` call to the
moment the receiver's tensors hold it (``load``: after its copies, synchronised; ``inplace``:
when ``recv()`` returned the checked update), and verified by the marks (state.py).

Faults: ``--kill-receiver-at K`` SIGKILLs the first receiver at update K and goes on;
``--die-at K`` SIGKILLs the trainer itself right after the K-th ``publish()`` returned (its
copies may still be in flight on the GPU): every receiver must then end with a clear error
and a model that holds one whole version. Receivers write their results to files in
``--dir``; the trainer writes the run's record to ``--out`` (not with ``--die-at``: run_all.py
reads the receivers' files then).

  python3 gpipe_run.py --size tiny --device cpu --receivers load@0,inplace@0 --out r.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import sys
import time
import traceback
from typing import Any, Optional

import torch

import state


def receiver(idx: int, mode: str, dev: str, sock: str, args: dict[str, Any], acks: Any) -> None:
    """One inference process: receive `updates` updates, ack each on `acks` (its own pipe to
    the trainer), write its results."""
    import gpipe
    import gpipe.torch

    torch.set_num_threads(1)
    device = torch.device(dev)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    names = [n for n, _, _ in state.shapes(args["size"])]
    # in place, the receiver has no tensors of its own: only their shapes, for the marks
    sd = state.make_state(args["size"], device if mode == "load" else torch.device("meta"),
                          fill="zeros")
    marks = state.Marks(list(sd.values()), device=device)
    mem = state.Memory(device)
    out: dict[str, Any] = {"idx": idx, "mode": mode, "device": dev, "pid": os.getpid(),
                           "versions": [], "bad": [], "error": None}
    rx = None
    try:
        rx = gpipe.torch.WeightReceiver(sock, device=dev, timeout=60.0)
        out["delivery"] = rx.consumer.delivery
        acks.send(("attached", idx, 0, 0, None))
        for _ in range(args["updates"]):
            if mode == "load":
                v = rx.load_into(sd)
                state.sync(device)
                t1 = state.now_ns()
                bad = marks.check(v)
            else:
                with rx.recv() as u:
                    t1 = state.now_ns()
                    v = u.version
                    bad = marks.check(v, [u.state_dict[n] for n in names])
            state.note_check(out, v, bad)
            mem.sample()
            try:
                acks.send(("ack", idx, v, t1, bad))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the trainer is gone (a --die-at run): the next recv says how
    except BaseException as e:  # a fault run ends here: record what the receiver saw
        out["error"] = {"type": type(e).__name__, "message": str(e)}
        if not isinstance(e, gpipe.Error):
            out["error"]["traceback"] = traceback.format_exc()
    out["last_version"] = rx.version if rx is not None else 0
    if mode == "load":
        cv = marks.consistent_version()
        out["model_version_mod250"] = cv
        out["model_whole"] = cv is not None and (out["last_version"] == 0 and cv == -1
                                                 or cv == out["last_version"] % 250)
    out["memory"] = mem.summary(args["warmup"])
    state.write_json(os.path.join(args["dir"], f"rx{idx}.json"), out)
    if rx is not None:
        rx.close()


def forwarder(ring: int, dev: Optional[int], up: str, sock: str, consumers: int, rundir: str,
              chunk: Optional[int]) -> None:
    """One ring of the fan-out plan: the parent ring re-published on GPU `dev` (None: a host
    ring, where the plan's GPU numbers only shape the tree), in chunks of `chunk` bytes."""
    import gpipe

    _wait_for(up)  # the parent ring: the trainer's, or a forwarder's that is starting too
    try:
        rep = gpipe.forward(up, sock, device=dev, slots=2, wait_for_consumers=consumers,
                            chunk=chunk)
    except BaseException as e:
        rep = {"error": f"{type(e).__name__}: {e}"}
    state.write_json(os.path.join(rundir, f"fwd{ring}.json"), rep)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=list(state.SIZES))
    ap.add_argument("--device", default="cuda", help="cuda (the trainer on GPU 0) or cpu (host backend)")
    ap.add_argument("--receivers", default="load@0", help="MODE@GPU,...: load or inplace, on GPU N")
    ap.add_argument("--shape", default="direct", help="to other GPUs: direct, or a fan-out shape (auto, chain, tree)")
    ap.add_argument("--chunk", default="0",
                    help="forwarders copy each update in chunks of this many bytes, so that the "
                         "hops of a chain overlap; auto: the fan-out plan's chunk for one update "
                         "at a time (gpipe.fanout_plan(one_at_a_time=True)); 0: whole updates")
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--copy", default="auto", help="WeightPublisher copy=")
    ap.add_argument("--in-slot", action="store_true",
                    help="WeightPublisher in_slot=True: the trainer's tensors live in the ring's one slot")
    ap.add_argument("--kill-receiver-at", type=int, default=0)
    ap.add_argument("--die-at", type=int, default=0)
    ap.add_argument("--ack-timeout", type=float, default=60.0)
    ap.add_argument("--dir", required=True, help="run directory: sockets and receivers' results")
    ap.add_argument("--out", help="the run's record (JSON)")
    ap.add_argument("--name", default="gpipe")
    a = ap.parse_args()

    import gpipe
    import gpipe.torch

    torch.set_num_threads(1)
    os.makedirs(a.dir, exist_ok=True)
    cuda = a.device == "cuda"
    device = torch.device("cuda:0" if cuda else "cpu")
    specs = []
    for s in a.receivers.split(","):
        mode, _, g = s.partition("@")
        if mode not in ("load", "inplace"):
            raise SystemExit(f"--receivers: mode {mode!r} is not load or inplace")
        specs.append((mode, int(g or 0)))
    sd = state.make_state(a.size, device)
    mem = state.Memory(device)
    sock = os.path.join(a.dir, "w0.sock")
    pub = gpipe.torch.WeightPublisher(sock, sd, slots=2, copy=a.copy, in_slot=a.in_slot,
                                      drain_timeout=30.0)
    marks = state.Marks(list(sd.values()))  # after: with --in-slot the tensors moved

    # Which ring each receiver reads: ring 0 (the trainer's) directly, or a forwarder's.
    rx_socks = [sock] * len(specs)
    rings = [{"device": 0, "parent": None}]
    others = [i for i, (_, g) in enumerate(specs) if g != 0]
    chunk = None if a.chunk in ("0", "auto") else int(a.chunk)
    if others and a.shape != "direct":  # on the host too: the same rings, in host memory
        plan = gpipe.fanout_plan([specs[i][1] for i in others], shape=a.shape,
                                 batch_bytes=pub.producer.slot_bytes, one_at_a_time=True)
        if a.chunk == "auto":
            chunk = plan["chunk_bytes"]
        rings = plan["rings"]
        for k, i in enumerate(others):
            rx_socks[i] = os.path.join(a.dir, f"w{plan['consumer_ring'][k]}.sock")
    ring_consumers = [0] * len(rings)
    for s in rx_socks:
        ring_consumers[int(os.path.basename(s)[1:-5])] += 1
    for r in rings[1:]:
        ring_consumers[r["parent"]] += 1

    ctx = mp.get_context("spawn")
    # One pipe per receiver, not one queue for all: a receiver SIGKILLed while it writes to a
    # shared queue can leave the queue's lock held, and every other receiver then blocks on it.
    acks = Acks(ctx, len(specs))
    cfg = {"size": a.size, "updates": a.updates, "warmup": a.warmup, "dir": a.dir}
    fwds = []
    for r, ring in enumerate(rings[1:], start=1):
        up = os.path.join(a.dir, f"w{ring['parent']}.sock")
        mine = os.path.join(a.dir, f"w{r}.sock")
        fdev = ring["device"] if cuda else None
        p = ctx.Process(target=forwarder,
                        args=(r, fdev, up, mine, ring_consumers[r], a.dir, chunk))
        p.start()
        fwds.append(p)
    procs = []
    for i, (mode, g) in enumerate(specs):
        dev = f"cuda:{g}" if cuda else "cpu"
        # a receiver attaches once its ring exists: a forwarder's socket appears when it starts
        p = ctx.Process(target=_receiver_when_ready,
                        args=(i, mode, dev, rx_socks[i], cfg, acks.writers[i]))
        p.start()
        procs.append(p)
    acks.started()

    record: dict[str, Any] = {
        "run": a.name, "size": a.size, "backend": "cuda" if cuda else "host",
        "device": state.device_name(device), "tensors": len(sd), "bytes": pub.layout.nbytes,
        "receivers": [f"{m}@{g}" for m, g in specs], "shape": a.shape if others else "same-gpu",
        "rings": rings, "chunk": chunk, "updates": a.updates, "warmup": a.warmup,
        "copy": "none (in slot)" if a.in_slot else pub.copy,
        "slot_bytes": pub.producer.slot_bytes, "memory_path": pub.producer.memory,
    }
    attached, deadline = 0, state.now_ns() + 180e9
    while attached < len(specs):  # every receiver attached, or one that gave up says why
        try:
            kind, *_ = acks.get(timeout=1.0)
            attached += kind == "attached"
        except TimeoutError:
            gone = [(i, p.exitcode) for i, p in enumerate(procs) if not p.is_alive()]
            gone += [(f"forwarder {r}", p.exitcode) for r, p in enumerate(fwds, 1) if not p.is_alive()]
            if gone or state.now_ns() > deadline:
                raise SystemExit(f"gpipe_run: {attached} of {len(specs)} receivers attached; ended "
                                 f"before attaching: {gone}; see {a.dir}/rx*.json, fwd*.json: "
                                 + _errors(a.dir))
    pub.wait_for_receivers(ring_consumers[0], timeout=60.0)
    alive = set(range(len(specs)))
    latency: dict[int, list[int]] = {i: [] for i in alive}
    update_ns, publish_ns, pack_ns = [], [], []
    problems: list[str] = []
    killed: Optional[int] = None
    for v in range(1, a.updates + 1):
        marks.write(v)
        state.sync(device)
        if a.kill_receiver_at and v == a.kill_receiver_at:
            os.kill(procs[0].pid, signal.SIGKILL)
            killed = 0
            alive.discard(0)
        t0 = state.now_ns()
        got = pub.publish(user=[t0])
        t_host = state.now_ns()
        if a.die_at and v == a.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if cuda:  # this stream only: gpipe's own stream may hold waits for the receivers
            torch.cuda.current_stream(device).synchronize()
        t_pack = state.now_ns()
        if got != v:
            problems.append(f"publish returned version {got} for update {v}")
        waiting = set(alive)
        last = t0
        while waiting:
            try:
                kind, i, rv, t1, bad = acks.get(timeout=1.0)
            except TimeoutError:
                if state.now_ns() - t0 > a.ack_timeout * 1e9:
                    problems.append(f"update {v}: no ack from receivers {sorted(waiting)} in {a.ack_timeout} s")
                    waiting.clear()
                    alive.clear()
                for i in list(waiting):
                    if not procs[i].is_alive():
                        problems.append(f"receiver {i} died at update {v}")
                        waiting.discard(i)
                        alive.discard(i)
                continue
            if kind != "ack" or i not in waiting:
                continue
            if rv != v:
                problems.append(f"receiver {i} acked version {rv} for update {v}")
            if bad:
                problems.append(f"receiver {i} update {v}: {bad}")
            waiting.discard(i)
            latency[i].append(t1 - t0)
            last = max(last, t1)
        update_ns.append(last - t0)
        publish_ns.append(t_host - t0)
        pack_ns.append(t_pack - t0)
        mem.sample()
        if not alive:
            break
    counters = pub.close()
    for p in procs + fwds:
        p.join(timeout=60.0)
        if p.is_alive():
            p.kill()
            problems.append(f"process {p.pid} did not end within 60 s of the close")
    w = a.warmup
    record.update({
        "update_ms": state.stats_ms(update_ns[w:]),
        "publish_call_ms": state.stats_ms(publish_ns[w:]),
        "pack_ms": state.stats_ms(pack_ns[w:]),
        "per_receiver_ms": {str(i): state.stats_ms(latency[i][w:]) for i in latency},
        "memory": {"trainer": mem.summary(w)},
        "counters": counters, "problems": problems, "killed_receiver": killed,
    })
    if killed is not None:
        k = a.kill_receiver_at
        record["before_kill_ms"] = state.stats_ms(update_ns[w:k - 1])
        record["after_kill_ms"] = state.stats_ms(update_ns[k:])
    rxs = []
    for i in range(len(specs)):
        try:
            with open(os.path.join(a.dir, f"rx{i}.json")) as f:
                r = json.load(f)
        except OSError:
            r = {"idx": i, "missing": True}
        rxs.append(r)
        if "memory" in r:
            record["memory"][f"rx{i}"] = r["memory"]
        if i != killed and not r.get("missing"):
            if r.get("error"):
                problems.append(f"receiver {i}: {r['error']['type']}: {r['error']['message']}")
            if r.get("bad"):
                problems.append(f"receiver {i}: {len(r['bad'])} updates failed their check")
            if r.get("versions") != list(range(1, a.updates + 1)):
                problems.append(f"receiver {i} received versions {r.get('versions')[:5]}... not 1..{a.updates}")
    for r in range(1, len(rings)):
        try:
            with open(os.path.join(a.dir, f"fwd{r}.json")) as f:
                record.setdefault("forwarders", []).append(json.load(f))
        except OSError:
            pass
    keys = ("idx", "mode", "device", "delivery", "error", "last_version", "model_whole")
    record["receivers_detail"] = [{k: r.get(k) for k in keys} for r in rxs]
    record["verified_updates"] = sum(len(r.get("versions", [])) - len(r.get("bad", [])) for r in rxs)
    record["ok"] = not problems
    return state.finish(a.out, record)


def _errors(rundir: str) -> str:
    """The errors the receivers and forwarders of a run wrote, in one line."""
    out = []
    for name in sorted(os.listdir(rundir)):
        if name.endswith(".json") and (name.startswith("rx") or name.startswith("fwd")):
            with open(os.path.join(rundir, name)) as f:
                err = json.load(f).get("error")
            if err:
                out.append(f"{name}: {err if isinstance(err, str) else err.get('message')}")
    return "; ".join(out) or "none written"


def _wait_for(sock: str, seconds: float = 120.0) -> None:
    """Waits until a ring's socket exists: a forwarder's appears once it started."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(sock) and time.monotonic() < deadline:
        time.sleep(0.02)


class Acks:
    """The receivers' messages to the trainer, one pipe each (`writers[i]` goes to receiver
    i). A pipe whose receiver died reads as closed and is dropped; the others go on."""

    def __init__(self, ctx: Any, n: int) -> None:
        pairs = [ctx.Pipe(duplex=False) for _ in range(n)]
        self.readers = [r for r, _ in pairs]
        self.writers = [w for _, w in pairs]

    def started(self) -> None:
        """The receivers hold their ends: close ours, so that a dead one's pipe reads closed."""
        for w in self.writers:
            w.close()

    def get(self, timeout: float) -> tuple:
        """The next message from any receiver; TimeoutError when none came within `timeout`."""
        end = state.now_ns() + timeout * 1e9
        while self.readers:
            left = (end - state.now_ns()) / 1e9
            if left <= 0:
                break
            for r in mp_connection.wait(self.readers, left):
                try:
                    return r.recv()
                except (EOFError, OSError):
                    self.readers.remove(r)
        if not self.readers:
            # Every receiver has gone: wait out the timeout as an empty queue would.
            left = (end - state.now_ns()) / 1e9
            if left > 0:
                time.sleep(left)
        raise TimeoutError


def _receiver_when_ready(idx: int, mode: str, dev: str, sock: str, cfg: dict[str, Any], acks: Any) -> None:
    _wait_for(sock)
    receiver(idx, mode, dev, sock, cfg, acks)


if __name__ == "__main__":
    sys.exit(main())

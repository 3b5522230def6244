"""fork() after attach: the child holds a copy of its parent's consumer (the same socket, the
same consumer index, the same held slots). It must refuse to use it, with an error that says
what to do, and must not act for the parent in any way (receive, release, say goodbye), so the
parent goes on as if nothing happened."""

from __future__ import annotations

import json

import numpy as np

import gpipe

# The parent: attaches, holds a batch, forks. The child tries every way of acting for the
# parent (recv, release, making a tensor, close, and dropping everything), then exits through
# Python's normal shutdown (finalizers run). The parent then receives on, checking contents.
PARENT = """
import gc, json, os, sys, numpy as np, gpipe
c = gpipe.Consumer(sys.argv[1])
print("attached", flush=True)
held = c.recv(timeout=10)
pid = os.fork()
if pid == 0:
    refused = {}
    for what, call in (
        ("recv", lambda: c.recv(timeout=1)),
        ("tensor", lambda: held["x"]),
        ("release", lambda: held.release()),
    ):
        try:
            call()
            refused[what] = None
        except gpipe.Error as e:
            refused[what] = str(e)
    c.close()
    del c, held, call
    gc.collect()
    print(json.dumps({"child": refused}), flush=True)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print(json.dumps({"child_exit": os.waitstatus_to_exitcode(status)}), flush=True)
x = np.from_dlpack(held["x"])
first_ok = bool((x == held.seq).all())
del x
held.release()
seqs, bad, end = [], 0, "ok"
try:
    for _ in range(200):
        with c.recv(timeout=10) as b:
            x = np.from_dlpack(b["x"])
            bad += int(not (x == b.seq).all())
            seqs.append(b.seq)
            del x
except gpipe.Error as e:
    end = f"{type(e).__name__}: {e}"
c.close()
print(json.dumps({"first_ok": first_ok, "received": len(seqs), "bad": bad, "end": end,
                  "contiguous": seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else False}),
      flush=True)
"""


def test_a_forked_child_refuses_its_parents_consumer_and_the_parent_goes_on(sock, child):
    p = gpipe.Producer(sock, backend="host", slots=4, batch_bytes=1 << 20)
    ch = child(PARENT, sock)
    p.wait_for_consumers(1, timeout=10)
    assert ch.readline() == "attached"
    s = 0
    lines = []
    # Publish until the parent has received its 200 batches (the child holds nothing).
    while len(lines) < 3:
        try:
            p.send({"x": np.full(4096, s, dtype=np.int64)}, timeout=0.05)
            s += 1
        except gpipe.Timeout:
            pass
        while not ch.lines.empty():
            line = ch.lines.get()
            assert line is not None, "".join(ch.err)
            lines.append(line.strip())
    rc, _, err = ch.wait()
    assert rc == 0, err
    child_report = json.loads(lines[0])["child"]
    for what, error in child_report.items():
        assert error is not None, f"the forked child could {what} with its parent's consumer"
        assert "forked" in error and "attach a new gpipe.Consumer" in error, error
    assert json.loads(lines[1]) == {"child_exit": 0}
    parent = json.loads(lines[2])
    assert parent["end"] == "ok", parent
    assert parent["first_ok"] and parent["bad"] == 0 and parent["contiguous"], parent
    assert parent["received"] == 200
    stats = p.close()
    # The parent left once, cleanly: the child neither said goodbye for it nor got it detached.
    assert (stats["detached"], stats["died"], stats["left"]) == (0, 0, 1), stats

"""Ctrl-C during blocking calls: `Consumer()` attach raises KeyboardInterrupt (not an
AttachError about an interrupted system call), and how long each blocking call takes to
answer SIGINT is measured (docs/python.md quotes these figures)."""

from __future__ import annotations

import random
import signal
import socket
import statistics
import time

import gpipe

CALLS = ("attach", "recv", "acquire")
ROUNDS = 8

# Blocks in each call ROUNDS times; prints the monotonic time at which KeyboardInterrupt
# arrived (or what else was raised). The attach is to a socket that never answers.
CHILD = """
import sys, time, numpy as np, gpipe
sock, silent, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = gpipe.Producer(sock + ".p", backend="host", slots=1, batch_bytes=1 << 20)
q = gpipe.Consumer(sock + ".p")          # attached, never reads
p.wait_for_consumers(1, timeout=5)
p.send(np.zeros(8, np.uint8))            # slot 0 now waits for q: acquire blocks
c = gpipe.Consumer(sock)                 # the test's producer never publishes: recv blocks
calls = {
    "attach": lambda: gpipe.Consumer(silent, timeout=60),
    "recv": lambda: c.recv(),
    "acquire": lambda: p.acquire(),
}
for what in sys.argv[4:]:
    for i in range(rounds):
        print("blocking", what, flush=True)
        try:
            calls[what]()
            print("returned", flush=True)
        except KeyboardInterrupt:
            print("interrupted", time.monotonic(), flush=True)
        except BaseException as e:
            print("raised", type(e).__name__, str(e).replace("\\n", " "), flush=True)
"""


def test_ctrl_c_interrupts_every_blocking_call_promptly(sock, child, report, tmp_path):
    # A "producer" that accepts nothing and says nothing: the attach waits for its Welcome.
    silent = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(silent)
    listener.listen(64)
    p = gpipe.Producer(sock, backend="host", slots=2, batch_bytes=1 << 20)
    ch = child(CHILD, sock, silent, str(ROUNDS), *CALLS)
    delays: dict[str, list[float]] = {}
    for what in CALLS:
        for _ in range(ROUNDS):
            assert ch.readline() == f"blocking {what}"
            # A random moment in the call's wait, so the figures cover its whole cycle.
            time.sleep(0.15 + random.random() * 0.1)
            sent = time.monotonic()
            ch.signal(signal.SIGINT)
            line = ch.readline()
            assert line.startswith("interrupted"), f"{what}: {line}"
            delays.setdefault(what, []).append(float(line.split()[1]) - sent)
    rc, _, err = ch.wait()
    assert rc == 0, err
    listener.close()
    p.close()
    for what, d in delays.items():
        report(
            f"Ctrl-C to KeyboardInterrupt, {what}: median {statistics.median(d) * 1000:.1f} ms, "
            f"max {max(d) * 1000:.1f} ms over {len(d)}"
        )
    # Each call checks for signals at least every 50 ms (gpipe-py's SLICE); allow for a loaded
    # 2-core CI machine.
    assert all(x < 0.25 for d in delays.values() for x in d), delays

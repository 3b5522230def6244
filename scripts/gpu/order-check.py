#!/usr/bin/env python3
"""Stream-ordering check of the Python package on a CUDA ring: the producer (this process)
zeroes a batch, runs a long kernel, then fills it with 5, on torch's current stream; a consumer
process sums it right away. If the consumer's stream waits for `ready`, it sees 5 * 1024 after
about the kernel's length; if not, it sees 0 at once. Each sync mode, the consumer's default
stream and a side stream. Usage: python3 scripts/gpu/order-check.py"""
import os, subprocess, sys, tempfile, time

import torch

import gpipe

CONSUMER = r"""
import sys, time, torch, gpipe
torch.zeros(1, device="cuda")
c = gpipe.Consumer(sys.argv[1])
print("attached", flush=True)
b = c.recv(timeout=30)
s = torch.cuda.current_stream() if sys.argv[2] == "default" else torch.cuda.Stream()
t0 = time.monotonic()
with torch.cuda.stream(s):
    v = torch.from_dlpack(b["x"]).sum()
pending = not s.query()
v = int(v.item())
print("result", v, round(time.monotonic() - t0, 3), "pending-after-enqueue", pending, flush=True)
b.release()
"""

d = tempfile.mkdtemp(prefix="gp-order-")
for sync in ("semaphore", "events"):
    for cstream in ("default", "side"):
        sock = os.path.join(d, f"{sync}-{cstream}.sock")
        p = gpipe.Producer(sock, slots=2, batch_bytes=2 << 20, backend="cuda", sync=sync)
        ch = subprocess.Popen([sys.executable, "-c", CONSUMER, sock, cstream], stdout=subprocess.PIPE, text=True)
        assert ch.stdout.readline().strip() == "attached"
        p.wait_for_consumers(1, timeout=30)
        with p.acquire() as slot:
            x = torch.from_dlpack(slot.tensor("x", torch.int32, (1024,)))
            x.zero_()
            torch.cuda._sleep(1_500_000_000)
            x.fill_(5)
            slot.publish()
        busy = not torch.cuda.current_stream().query()
        out = ch.stdout.readline().strip()
        p.close()
        ch.wait(timeout=30)
        print(f"sync={sync} consumer-stream={cstream} producer-stream-busy-after-publish={busy} :: {out}", flush=True)

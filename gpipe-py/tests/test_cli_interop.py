"""Python and the gpipe CLI on one ring: the CLI's pattern batches in Python, and Python's
pattern batches verified by `gpipe consume --verify`."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

import gpipe


def test_gpipe_produce_feeds_a_python_consumer(sock, gpipe_bin):
    prod = subprocess.Popen(
        # Shared mode: batches published before the consumer attaches wait for it.
        [gpipe_bin, "produce", "--backend", "host", "--socket", sock, "--mode", "shared", "--slots", "4",
         "--batch-bytes", "1MiB", "--batches", "200"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                c = gpipe.Consumer(sock)
                break
            except gpipe.AttachError:
                assert time.monotonic() < deadline, "gpipe produce did not start listening"
                time.sleep(0.05)
        seqs = []
        for b in c:
            with b:
                assert b.names == ["data"]
                assert b.verify_pattern(), f"batch {b.seq} does not match the CLI's pattern"
                seqs.append(b.seq)
        assert seqs == list(range(200))
    finally:
        prod.kill()
        prod.wait(timeout=10)


def test_a_python_producer_feeds_gpipe_consume_verify(sock, gpipe_bin):
    p = gpipe.Producer(sock, backend="host", slots=4, batch_bytes=1 << 20)
    cons = subprocess.Popen(
        [gpipe_bin, "consume", "--socket", sock, "--verify", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        p.wait_for_consumers(1, timeout=20)
        for _ in range(100):
            with p.acquire(timeout=10) as s:
                meta = s.fill_pattern(65536)
                s.publish(meta=meta, nbytes=65536)
        p.close()
        out, err = cons.communicate(timeout=30)
        assert cons.returncode == 0, err
        report = json.loads(out.strip().splitlines()[-1])
        assert report["received"] == 100, report
        assert report["verified"] and report["mismatches"] == 0, report
    finally:
        cons.kill()

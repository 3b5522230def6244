#!/usr/bin/env python3
"""What a PyTorch user would write instead of gpipe: CUDA tensors over torch.multiprocessing queues.

One producer process (this one) and N consumer processes (spawn start method) do the same work
as gpipe's CUDA benchmark (`gpipe bench` with the CUDA backend):

* The producer fills a CUDA tensor of `--batch-bytes` bytes (int64 words) for each batch `seq`
  with gpipe's test pattern

      word[i] = (seq * 0x9E3779B97F4A7C15) ^ (i * 0xD1B54A32D192ED03) ^ 0x5851F42D4C957F2D

  (wrapping u64 arithmetic, held in torch int64 as two's complement). `i * 0xD1B5...` does not
  depend on `seq`, so it is computed once into a preallocated tensor and each fill is a single
  `bitwise_xor` with a scalar. The producer keeps a pool of `--slots` preallocated tensors and
  reuses them round-robin (no caching-allocator churn), synchronizes its stream before putting a
  tensor on a queue (CUDA IPC tensors carry no cross-process stream ordering once the consumer
  has the storage cached), and reuses a slot only after every consumer that got it acknowledged.
* `--mode broadcast`: one queue per consumer, every consumer gets every batch.
  `--mode shared`: one queue shared by all consumers, each batch goes to one of them.
* Each consumer receives (slot, seq, tensor), verifies it on the GPU against the pattern for
  `seq` (count of differing words) plus a wrapping sum-reduce of the tensor, synchronizes, and
  sends (consumer, slot, seq) back on the acknowledgement queue. At the end it reports what it
  received through a result queue.

Timing runs from the first timed batch (after `--warmup` batches, all acknowledged) until the last
acknowledgement of the last batch. `gb_per_s` counts each batch once (bytes handed over / s, as in
gpipe's report); `delivered_gb_per_s` counts it once per consumer that received it.

Run (needs a CUDA GPU and PyTorch):

    python3 benches/torch_mp_bench.py --consumers 4 --mode broadcast --batch-bytes 8MiB --json

Exit status: 0 on success, 1 if any batch failed verification or went missing or was duplicated,
2 on a consumer error or bad arguments, 3 if the `--timeout` watchdog fired.
"""

import argparse
import json
import os
import queue
import sys
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp

SEQ_MUL = 0x9E3779B97F4A7C15
IDX_MUL = 0xD1B54A32D192ED03
PATTERN_XOR = 0x5851F42D4C957F2D
MASK64 = (1 << 64) - 1


def to_i64(x):
    """The unsigned 64-bit value of x (mod 2**64) as a signed two's-complement int64."""
    x &= MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


def pattern_word_u64(seq, i):
    """gpipe's pattern word, computed with Python ints (reference for the self-checks)."""
    return ((seq * SEQ_MUL) & MASK64) ^ ((i * IDX_MUL) & MASK64) ^ PATTERN_XOR


def seq_scalar(seq):
    """The seq-dependent part of the pattern, `(seq * SEQ_MUL) ^ XOR`, as a signed int64."""
    return to_i64(((seq * SEQ_MUL) & MASK64) ^ PATTERN_XOR)


def make_idx_term(nwords, device):
    """`arange(nwords) * IDX_MUL` with wrapping int64 multiplication, checked against Python."""
    idx = torch.arange(nwords, device=device, dtype=torch.int64)
    idx_term = idx * to_i64(IDX_MUL)
    del idx
    n = min(nwords, 2048)
    picks = list(range(n)) + list(range(max(n, nwords - n), nwords))
    got = idx_term[torch.tensor(picks, device=device, dtype=torch.int64)].cpu().tolist()
    want = [to_i64(i * IDX_MUL) for i in picks]
    if got != want:
        raise RuntimeError("torch int64 multiplication did not wrap as expected (idx * IDX_MUL)")
    return idx_term


def parse_size(text):
    """Byte size: plain int, or K/KiB, M/MiB, G/GiB (powers of 1024), KB/MB/GB (powers of 1000)."""
    t = text.strip()
    split = len(t)
    for pos, ch in enumerate(t):
        if not ch.isdigit():
            split = pos
            break
    num, unit = t[:split], t[split:].strip().lower()
    mults = {
        "": 1, "b": 1,
        "k": 1 << 10, "kib": 1 << 10,
        "m": 1 << 20, "mib": 1 << 20,
        "g": 1 << 30, "gib": 1 << 30,
        "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3,
    }
    if not num or unit not in mults:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (examples: 4096, 64KiB, 8MiB, 1GiB)")
    return int(num) * mults[unit]


def format_size(b):
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if b >= (1 << shift) and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def start_watchdog(seconds, what, before_exit=None):
    """Daemon thread that ends the process with status 3 after `seconds`, unless cancelled."""
    cancel = threading.Event()

    def run():
        if cancel.wait(seconds):
            return
        print(f"torch_mp_bench: {what}: timeout after {seconds:.0f} s, exiting",
              file=sys.stderr, flush=True)
        if before_exit is not None:
            try:
                before_exit()
            except BaseException:
                pass
        os._exit(3)

    threading.Thread(target=run, name="watchdog", daemon=True).start()
    return cancel


def consumer_main(cid, in_q, ack_q, result_q, nwords, device_index, keep_refs, timeout_s,
                  parent_pid):
    """Consumer process: verify every batch it gets, acknowledge it, report at the end."""
    # Outlive the producer's watchdog a little, so the producer reports the timeout first.
    start_watchdog(timeout_s + 30.0, f"consumer {cid}")
    try:
        torch.cuda.set_device(device_index)
        device = torch.device("cuda", device_index)
        idx_term = make_idx_term(nwords, device)
        scratch = torch.empty(nwords, device=device, dtype=torch.int64)
        bad_words = torch.zeros((), device=device, dtype=torch.int64)
        bad_batches = torch.zeros((), device=device, dtype=torch.int64)
        checksum = torch.zeros((), device=device, dtype=torch.int64)
        torch.cuda.synchronize(device)
        ack_q.put(("ready", cid, None))

        # Keeping the last tensor received for each slot keeps its storage alive, so torch's
        # shared_cache maps the next send of that slot to the already opened IPC handle instead
        # of opening (cudaIpcOpenMemHandle) and closing it for every batch.
        held = {}
        received = 0
        wrong_shape = 0
        out_of_order = 0
        last_seq = -1
        while True:
            try:
                item = in_q.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent_pid:
                    print(f"torch_mp_bench: consumer {cid}: producer is gone, exiting",
                          file=sys.stderr, flush=True)
                    os._exit(4)
                continue
            if item is None:
                break
            slot, seq, t = item
            received += 1
            if seq <= last_seq:
                out_of_order += 1
            last_seq = seq
            if (t.device != device or t.dtype != torch.int64 or t.dim() != 1
                    or t.numel() != nwords):
                wrong_shape += 1
                bad_batches += 1
            else:
                # t ^ expected == (t ^ idx_term) ^ seq_scalar: zero where the word is right.
                torch.bitwise_xor(t, idx_term, out=scratch)
                scratch.bitwise_xor_(seq_scalar(seq))
                bad = torch.count_nonzero(scratch)
                bad_words.add_(bad)
                bad_batches.add_(bad.ne(0).to(torch.int64))
                checksum.add_(t.sum())
            # Done with the tensor's memory before telling the producer it may reuse the slot.
            torch.cuda.current_stream(device).synchronize()
            if keep_refs:
                held[slot] = t
            del t, item
            ack_q.put(("ack", cid, slot, seq))

        held.clear()
        torch.cuda.synchronize(device)
        result_q.put(("result", cid, {
            "consumer": cid,
            "received": received,
            "mismatches": int(bad_batches.item()),
            "mismatched_words": int(bad_words.item()),
            "wrong_shape": wrong_shape,
            "out_of_order": out_of_order,
            "checksum": int(checksum.item()) & MASK64,
        }))
    except BaseException:
        text = traceback.format_exc()
        print(f"torch_mp_bench: consumer {cid} failed:\n{text}", file=sys.stderr, flush=True)
        try:
            ack_q.put(("error", cid, text))
            ack_q.close()
            ack_q.join_thread()
        except BaseException:
            pass
        sys.exit(2)


class BenchError(Exception):
    pass


def main():
    ap = argparse.ArgumentParser(
        description="PyTorch baseline for gpipe's CUDA benchmark: CUDA tensors passed through "
                    "torch.multiprocessing queues from one producer to N consumers.")
    ap.add_argument("--consumers", type=int, default=1, help="consumer processes (default 1)")
    ap.add_argument("--mode", choices=("broadcast", "shared"), default="broadcast",
                    help="broadcast: every consumer gets every batch; shared: each batch goes "
                         "to one consumer (default broadcast)")
    ap.add_argument("--batch-bytes", type=parse_size, default=parse_size("8MiB"),
                    help="bytes per batch, a multiple of 8: 4096, 64KiB, 8MiB, 1GiB "
                         "(default 8MiB)")
    ap.add_argument("--batches", type=int, default=500, help="timed batches (default 500)")
    ap.add_argument("--slots", type=int, default=8,
                    help="preallocated tensors reused round-robin (default 8)")
    ap.add_argument("--warmup", type=int, default=20,
                    help="batches sent before timing starts (default 20)")
    ap.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    ap.add_argument("--drop-refs", action="store_true",
                    help="consumers drop each tensor after use instead of keeping the last one "
                         "per slot (then every batch reopens the CUDA IPC handle)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="hard limit for the whole run in seconds; exits with status 3 "
                         "(default 300)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()

    if args.consumers < 1 or args.batches < 1 or args.slots < 1 or args.warmup < 0:
        ap.error("--consumers, --batches and --slots must be >= 1, --warmup >= 0")
    if args.batch_bytes < 8 or args.batch_bytes % 8 != 0:
        ap.error("--batch-bytes must be a positive multiple of 8")
    if args.timeout <= 0:
        ap.error("--timeout must be positive")

    procs = []

    def kill_children():
        for p in procs:
            if p.exitcode is None:
                p.kill()

    watchdog = start_watchdog(args.timeout, "producer", kill_children)

    mp.set_start_method("spawn")
    broadcast = args.mode == "broadcast"
    n = args.consumers
    nwords = args.batch_bytes // 8
    total = args.warmup + args.batches
    expected_acks = n if broadcast else 1

    torch.cuda.set_device(args.device)
    device = torch.device("cuda", args.device)
    device_name = torch.cuda.get_device_name(args.device)

    if broadcast:
        in_queues = [mp.Queue() for _ in range(n)]
    else:
        in_queues = [mp.Queue()]
    ack_q = mp.Queue()
    result_q = mp.Queue()

    for cid in range(n):
        q = in_queues[cid] if broadcast else in_queues[0]
        p = mp.Process(target=consumer_main, name=f"consumer-{cid}",
                       args=(cid, q, ack_q, result_q, nwords, args.device, not args.drop_refs,
                             args.timeout, os.getpid()))
        p.start()
        procs.append(p)

    # Producer state, while the consumers start up.
    idx_term = make_idx_term(nwords, device)
    pool = [torch.empty(nwords, device=device, dtype=torch.int64) for _ in range(args.slots)]
    # Self-check of the fill against the Python reference (head and tail of one batch).
    probe_seq = 0x0123456789
    torch.bitwise_xor(idx_term, seq_scalar(probe_seq), out=pool[0])
    k = min(nwords, 1024)
    picks = list(range(k)) + list(range(max(k, nwords - k), nwords))
    got = pool[0][torch.tensor(picks, device=device, dtype=torch.int64)].cpu().tolist()
    if got != [to_i64(pattern_word_u64(probe_seq, i)) for i in picks]:
        raise BenchError("the torch fill does not match gpipe's pattern")
    torch.cuda.synchronize(device)

    pending = [0] * args.slots        # acknowledgements still owed for the slot's current batch
    slot_seq = [-1] * args.slots      # batch now in the slot
    ackers = [set() for _ in range(args.slots)]
    problems = []
    acks = 0

    def check_children():
        for i, p in enumerate(procs):
            if p.exitcode is not None:
                raise BenchError(f"consumer {i} exited early with status {p.exitcode}")

    def next_control():
        """Next message on the acknowledgement queue; fails if a consumer died."""
        while True:
            try:
                return ack_q.get(timeout=1.0)
            except queue.Empty:
                check_children()

    def handle(msg):
        nonlocal acks
        kind = msg[0]
        if kind == "error":
            raise BenchError(f"consumer {msg[1]} failed:\n{msg[2]}")
        if kind != "ack":
            raise BenchError(f"unexpected message {msg[:2]!r}")
        _, cid, slot, seq = msg
        if not (0 <= slot < args.slots) or slot_seq[slot] != seq or pending[slot] <= 0:
            problems.append(f"consumer {cid} acknowledged slot {slot} seq {seq}, "
                            f"which was not outstanding")
            return
        if cid in ackers[slot]:
            problems.append(f"consumer {cid} acknowledged seq {seq} twice")
            return
        ackers[slot].add(cid)
        pending[slot] -= 1
        acks += 1

    def wait_slot(slot):
        while pending[slot] > 0:
            handle(next_control())

    def wait_all():
        for s in range(args.slots):
            wait_slot(s)

    ready = 0
    while ready < n:
        msg = next_control()
        if msg[0] == "ready":
            ready += 1
        else:
            handle(msg)

    stream = torch.cuda.current_stream(device)
    t0 = time.perf_counter()
    for seq in range(total):
        if seq == args.warmup:
            wait_all()
            t0 = time.perf_counter()
        slot = seq % args.slots
        wait_slot(slot)
        buf = pool[slot]
        torch.bitwise_xor(idx_term, seq_scalar(seq), out=buf)
        # The consumers read this memory on their own streams: it must be complete first.
        stream.synchronize()
        slot_seq[slot] = seq
        pending[slot] = expected_acks
        ackers[slot] = set()
        if broadcast:
            for q in in_queues:
                q.put((slot, seq, buf))
        else:
            in_queues[0].put((slot, seq, buf))
    wait_all()
    elapsed = time.perf_counter() - t0

    # Shutdown: one sentinel per consumer, then collect the reports and join.
    for q in in_queues:
        for _ in range(1 if broadcast else n):
            q.put(None)
    reports = {}
    while len(reports) < n:
        try:
            _, cid, rep = result_q.get(timeout=1.0)
            reports[cid] = rep
            continue
        except queue.Empty:
            pass
        try:
            while True:
                handle(ack_q.get_nowait())
        except queue.Empty:
            pass
        for i, p in enumerate(procs):
            if i not in reports and p.exitcode is not None:
                raise BenchError(f"consumer {i} exited with status {p.exitcode} "
                                 f"before reporting")
    for i, p in enumerate(procs):
        p.join(timeout=30.0)
        if p.exitcode is None:
            problems.append(f"consumer {i} did not exit; killed")
            p.kill()
            p.join()
        elif p.exitcode != 0:
            problems.append(f"consumer {i} exited with status {p.exitcode}")
    for q in in_queues + [ack_q, result_q]:
        q.close()
        q.join_thread()

    per_consumer = [reports[i] for i in range(n)]
    mismatches = sum(r["mismatches"] for r in per_consumer)
    received = [r["received"] for r in per_consumer]
    if acks != total * expected_acks:
        problems.append(f"{acks} acknowledgements, expected {total * expected_acks}")
    if broadcast:
        for i, got_n in enumerate(received):
            if got_n != total:
                problems.append(f"consumer {i} received {got_n} batches, expected {total}")
    elif sum(received) != total:
        problems.append(f"consumers received {sum(received)} batches in all, expected {total}")
    for r in per_consumer:
        if r["wrong_shape"]:
            problems.append(f"consumer {r['consumer']} got {r['wrong_shape']} tensors of the "
                            f"wrong device, dtype or size")
        if r["out_of_order"]:
            problems.append(f"consumer {r['consumer']} got {r['out_of_order']} batches out of "
                            f"order")
    if mismatches:
        problems.append(f"{mismatches} batches failed verification")

    delivered_per_batch = n if broadcast else 1
    result = {
        "tool": "torch.multiprocessing",
        "mode": args.mode,
        "consumers": n,
        "slots": args.slots,
        "batch_bytes": args.batch_bytes,
        "batches": args.batches,
        "warmup": args.warmup,
        "elapsed_s": elapsed,
        "batches_per_s": args.batches / elapsed,
        "gb_per_s": args.batches * args.batch_bytes / elapsed / 1e9,
        "delivered_gb_per_s": args.batches * args.batch_bytes * delivered_per_batch
                              / elapsed / 1e9,
        "mismatches": mismatches,
        "keep_refs": not args.drop_refs,
        "per_consumer": per_consumer,
        "problems": problems,
        "torch": torch.__version__,
        "device": device_name,
    }
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(f"torch.multiprocessing {args.mode}: {n} consumers, {format_size(args.batch_bytes)}"
              f" batches, {args.slots} slots: {args.batches} batches in {elapsed:.3f} s: "
              f"{result['batches_per_s']:.0f} batches/s, {result['gb_per_s']:.2f} GB/s handed "
              f"over ({result['delivered_gb_per_s']:.2f} GB/s delivered), "
              f"mismatches {mismatches} (torch {torch.__version__}, {device_name})", flush=True)
        for msg in problems:
            print(f"  problem: {msg}", flush=True)

    # Consumers have exited and released their IPC references: the pool can go now.
    del buf
    pool.clear()
    watchdog.set()
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        code = main()
    except BenchError as e:
        print(f"torch_mp_bench: {e}", file=sys.stderr, flush=True)
        for child in mp.active_children():
            child.kill()
        code = 2
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        # Our own consumer processes only; otherwise exit would wait on them until the timeout.
        for child in mp.active_children():
            child.kill()
        code = 2
    sys.exit(code)

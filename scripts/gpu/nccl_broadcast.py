"""NCCL broadcast bandwidth from GPU 0 to every other visible GPU, the yardstick of the
fan-out shapes (docs/multi-gpu.md): one process per GPU (torch.distributed, NCCL backend, NVLink multicast off),
a warm-up, then timed broadcasts. Prints one JSON line per size: the per-GPU GB/s (bytes each
GPU received / time), which is what a fan-out gives each consumer GPU.

    python3 scripts/gpu/nccl_broadcast.py --sizes 2MiB,64MiB,256MiB [--gpus N] [--gib 2]
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(s):
    for u, m in UNITS.items():
        if s.endswith(u):
            return int(s[: -len(u)]) * m
    return int(s)


def iters_for(nbytes, gib):
    # About `gib` GiB moved per GPU per size, at least 20 broadcasts.
    return max(20, min(20000, int(gib * (1 << 30)) // nbytes))


def worker(rank, world, sizes, port, q, gib):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        device_id=torch.device("cuda", rank),
    )
    for s in sizes:
        buf = torch.empty(s, dtype=torch.uint8, device="cuda")
        n = iters_for(s, gib)
        for _ in range(max(5, n // 10)):
            dist.broadcast(buf, src=0)
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(n):
            dist.broadcast(buf, src=0)
        torch.cuda.synchronize()
        secs = time.perf_counter() - t
        # The slowest rank's time is the broadcast's.
        tt = torch.tensor([secs], device="cuda")
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        if rank == 0:
            q.put({"what": "nccl-broadcast", "gpus": world, "bytes": s, "iters": n,
                   "seconds": tt.item(), "per_gpu_gb_per_s": s * n / tt.item() / 1e9,
                   "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                   "device": torch.cuda.get_device_name(0)})
        del buf
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2MiB,64MiB,256MiB")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", type=int, default=29631)
    ap.add_argument("--gib", type=float, default=2.0,
                    help="GiB each GPU receives in the timed broadcasts of a size (at least 20)")
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.spawn(worker, args=(a.gpus, sizes, a.port, q, a.gib), nprocs=a.gpus, join=True)
    for _ in sizes:
        print(json.dumps(q.get(timeout=60)), flush=True)


if __name__ == "__main__":
    main()

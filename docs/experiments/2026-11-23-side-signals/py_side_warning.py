"""Checks on the GPU host, under MPS, that a Python consumer taking side signals warns when
CUDA_DEVICE_MAX_CONNECTIONS is unset, and not when it is 8. Run by py-side-warning.sh."""
import json
import os
import subprocess
import sys
import warnings

import gpipe


def consumer(sock):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = gpipe.Consumer(sock, timeout=30)
    print(json.dumps({
        "side_signals": c.side_signals,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    }), flush=True)
    for b in c:
        b.release()


def main():
    out = {}
    for label, value in [("unset", None), ("8", "8")]:
        sock = f"/tmp/gp-warn-{os.getpid()}-{label}.sock"
        p = gpipe.Producer(sock, slots=2, batch_bytes=16 << 20, backend="cuda")
        env = dict(os.environ)
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        if value:
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = value
        kid = subprocess.Popen([sys.executable, __file__, "consumer", sock], env=env,
                               stdout=subprocess.PIPE, text=True)
        p.wait_for_consumers(1, timeout=60)
        line = kid.stdout.readline()
        p.close()
        kid.wait(timeout=60)
        out[label] = json.loads(line)
        print(label, out[label], flush=True)
    ok = (out["unset"]["side_signals"] and any("CUDA_DEVICE_MAX_CONNECTIONS" in w for w in out["unset"]["warnings"])
          and out["8"]["side_signals"] and not out["8"]["warnings"])
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "consumer":
        consumer(sys.argv[2])
    else:
        main()

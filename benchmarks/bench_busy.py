"""Wall time of ``semiring-backprop demo`` on a quiet machine and on one whose cores
another process keeps busy, measured in one run; prints both and their ratio.

The load is one process doing float32 matmuls with torch's default threads
(``--load matmul``, default) or one ``while True: pass`` loop per core (``--load spin``).
Each demo writes into a fresh directory (a rerun into the same one would resume).

    python benchmarks/bench_busy.py [--load matmul|spin] [--limit 1200]
    OMP_NUM_THREADS=1 python benchmarks/bench_busy.py     # the environment is passed on
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

LOADS = {
    "matmul": ["import torch\na = torch.randn(2000, 2000)\nwhile True:\n    a @ a"],
    "spin": ["while True:\n    pass"] * (os.cpu_count() or 1),
}


def _demo(out: str, limit: float) -> float | None:
    """Seconds one demo took, or None past ``limit`` (it is stopped then)."""
    cmd = [sys.executable, "-m", "semiring_backprop", "demo", "--out", out]
    start = time.perf_counter()
    try:
        subprocess.run(cmd, check=True, timeout=limit, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)  # fmt: skip
    except subprocess.TimeoutExpired:
        return None
    return time.perf_counter() - start


def _cores_in_use(seconds: float = 2.0) -> float | None:
    """Cores other work keeps busy now (Linux ``/proc/stat``), to check "quiet"."""
    try:
        with open("/proc/stat") as f:
            a = [int(v) for v in f.readline().split()[1:]]
        time.sleep(seconds)
        with open("/proc/stat") as f:
            b = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    d = [y - x for x, y in zip(a, b)]
    idle = d[3] + d[4]  # idle, iowait
    return (os.cpu_count() or 1) * (1 - idle / max(sum(d), 1))


def _show(seconds: float | None, limit: float) -> str:
    return f"> {limit:.0f} s (stopped)" if seconds is None else f"{seconds:.1f} s"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", choices=list(LOADS), default="matmul")
    ap.add_argument("--limit", type=float, default=1200, help="stop a demo after this many s")
    args = ap.parse_args(argv)
    before = _cores_in_use()
    with tempfile.TemporaryDirectory() as tmp:
        quiet = _demo(os.path.join(tmp, "quiet"), args.limit)
        load = [subprocess.Popen([sys.executable, "-c", code]) for code in LOADS[args.load]]
        try:
            time.sleep(3)  # the load has imported torch and is computing
            busy = _demo(os.path.join(tmp, "busy"), args.limit)
        finally:
            for p in load:
                p.kill()
                p.wait()
    threads = os.environ.get("OMP_NUM_THREADS", "not set")
    print(f"semiring-backprop demo, {os.cpu_count()} cores, load: {args.load}, "
          f"OMP_NUM_THREADS {threads}")  # fmt: skip
    if before is not None:
        print(f"cores in use before the quiet run: {before:.1f}"
              + (" (not quiet: other work is running)" if before > 0.3 else ""))  # fmt: skip
    print(f"quiet: {_show(quiet, args.limit)}")
    print(f"busy:  {_show(busy, args.limit)}")
    if quiet is not None:
        ratio = (busy if busy is not None else args.limit) / quiet
        print(f"busy / quiet: {'> ' if busy is None else ''}{ratio:.1f}x")


if __name__ == "__main__":
    main()

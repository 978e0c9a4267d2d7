#!/usr/bin/env python3
"""The Jupyter kernel's bench: rvisor's kernel and IRkernel side by side in
one run, both driven through jupyter_client, medians in milliseconds.

  python3 scripts/bench-kernel.py [--rvisor target/release/rvisor] [--reps N]
      [--json] [-- rvisor kernel flags...]

Rows: `1+1` execute round trip (request sent to reply and idle), an error,
a base plot, a ggplot (display_data), kernel start to the first result,
interrupt of `repeat {}` (interrupt sent to the cell's reply), restart to
the first result. rvisor's kernel runs confined (its default) unless flags
say otherwise; IRkernel runs in plain R (Debian r-cran-irkernel).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from jupyter_client import KernelManager

TIMEOUT = 120


def specs(rvisor, flags):
    prefix = tempfile.mkdtemp(prefix="rvisor-bench-kernels-")
    subprocess.run([rvisor, "kernel", "install", "--prefix", prefix, "--"] + flags,
                   check=True, capture_output=True)
    ir = os.path.join(prefix, "share", "jupyter", "kernels", "ir")
    os.makedirs(ir)
    with open(os.path.join(ir, "kernel.json"), "w") as f:
        # IRkernel's own spec (IRkernel::installspec writes this argv).
        json.dump({"argv": ["R", "--slave", "-e", "IRkernel::main()", "--args",
                            "{connection_file}"],
                   "display_name": "R (IRkernel)", "language": "R"}, f)
    os.environ["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter")
    return prefix


def run(kc, code):
    """Sends one cell and waits for its reply and its idle; the reply."""
    msg_id = kc.execute(code)
    reply = None
    idle = False
    deadline = time.monotonic() + TIMEOUT
    while reply is None:
        m = kc.get_shell_msg(timeout=deadline - time.monotonic())
        if m["parent_header"].get("msg_id") == msg_id:
            reply = m["content"]
    while not idle:
        m = kc.get_iopub_msg(timeout=deadline - time.monotonic())
        if (m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "status"
                and m["content"]["execution_state"] == "idle"):
            idle = True
    return reply


def start(name):
    km = KernelManager(kernel_name=name)
    t = time.perf_counter()
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=TIMEOUT)
    r = run(kc, "1+1")
    took = time.perf_counter() - t
    assert r["status"] == "ok", r
    return km, kc, took


def timed(kc, code, reps, want="ok"):
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        r = run(kc, code)
        out.append(time.perf_counter() - t)
        assert r["status"] == want, (code, r)
    return out


def interrupt(km, kc, reps):
    out = []
    for _ in range(reps):
        msg_id = kc.execute("repeat {}")
        deadline = time.monotonic() + TIMEOUT
        while True:
            m = kc.get_iopub_msg(timeout=deadline - time.monotonic())
            if m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "execute_input":
                break
        time.sleep(0.2)  # the loop is running in R (not a measured wait)
        t = time.perf_counter()
        km.interrupt_kernel()
        while True:
            m = kc.get_shell_msg(timeout=deadline - time.monotonic())
            if m["parent_header"].get("msg_id") == msg_id:
                break
        out.append(time.perf_counter() - t)
        # Drain to its idle.
        while True:
            m = kc.get_iopub_msg(timeout=deadline - time.monotonic())
            if (m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "status"
                    and m["content"]["execution_state"] == "idle"):
                break
        assert run(kc, "x")["status"] == "ok"
    return out


def restart(km, kc, reps):
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        km.restart_kernel(now=False)
        kc.wait_for_ready(timeout=TIMEOUT)
        assert run(kc, "1+1")["status"] == "ok"
        out.append(time.perf_counter() - t)
    return out


def bench(name, reps):
    rows = {}
    starts = []
    for _ in range(max(2, reps // 10)):
        km, kc, took = start(name)
        starts.append(took)
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    rows["start to first result"] = starts
    km, kc, _ = start(name)
    try:
        run(kc, "x <- 1; library(ggplot2); d <- data.frame(a = 1:100, b = rnorm(100))")
        run(kc, "plot(1)")
        rows["1+1"] = timed(kc, "1+1", reps)
        rows["error"] = timed(kc, "stop('no')", reps, want="error")
        rows["base plot"] = timed(kc, "plot(1:10)", max(3, reps // 3))
        rows["ggplot"] = timed(kc, "print(ggplot(d, aes(a, b)) + geom_point())", max(3, reps // 3))
        rows["interrupt repeat {}"] = interrupt(km, kc, max(3, reps // 10))
        rows["restart to first result"] = restart(km, kc, max(2, reps // 10))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rvisor", default="target/release/rvisor")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", action="store_true")
    p.add_argument("flags", nargs="*")
    a = p.parse_args()
    prefix = specs(os.path.abspath(a.rvisor), a.flags)
    try:
        result = {name: bench(name, a.reps) for name in ["rvisor", "ir"]}
    finally:
        shutil.rmtree(prefix, ignore_errors=True)
    med = {k: {row: statistics.median(v) * 1000 for row, v in rows.items()}
           for k, rows in result.items()}
    if a.json:
        print(json.dumps({"median_ms": med, "samples": {k: {r: len(v) for r, v in rows.items()}
                                                         for k, rows in result.items()}}))
        return
    print(f"{'row (median ms)':28} {'rvisor':>10} {'IRkernel':>10} {'ratio':>7}")
    for row in med["rvisor"]:
        r, i = med["rvisor"][row], med["ir"][row]
        print(f"{row:28} {r:10.1f} {i:10.1f} {r / i:7.2f}  (n={len(result['rvisor'][row])})")


if __name__ == "__main__":
    main()

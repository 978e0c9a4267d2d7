#!/usr/bin/env python3
"""The Jupyter kernel's bench: rvisor's kernel and IRkernel side by side in
one run, both driven through jupyter_client, medians in milliseconds.

  python3 scripts/bench-kernel.py [--rvisor target/release/rvisor] [--reps N]
      [--json] [-- rvisor kernel flags...]

Rows: `1+1` execute round trip (request sent to reply and idle), an error,
a base plot, a ggplot (display_data; also the CPU time per cell of the
kernel's processes, which a loaded machine sways less: for rvisor its
kernel host's, zygotes' and workers'), kernel start to the first result
(three first starts with nothing running, each of rvisor's starting its
own kernel host, and later ones), interrupt of `repeat {}` (interrupt sent to the cell's
reply), restart to the first result through jupyter_client's
`restart_kernel` and `wait_for_ready`, and the restart's kernel part:
shutdown_request sent to the new kernel's first execute_reply, with the
process's exit waited for directly and the client's sockets reconnecting
every 1 ms (jupyter_client polls the old process every 100 ms,
`wait_for_ready` drains iopub for 200 ms, and libzmq's sockets reconnect
every 100 ms by default: floors of the client, the same for both kernels).
rvisor's kernel runs confined (its default) unless flags say otherwise;
IRkernel runs in plain R (Debian r-cran-irkernel).
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

import zmq
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
    # A kernel host of the bench's own, so its first start is a cold one.
    os.environ["RVISOR_KERNEL_HOST_DIR"] = os.path.join(prefix, "hosts")
    # jupyter_client's first look-up of a kernelspec takes ~0.5 s of its
    # own (finding specs and provisioners), once per process: paid here
    # for both, not in the first kernel's start.
    for name in ("rvisor", "ir"):
        assert KernelManager(kernel_name=name).kernel_spec is not None, name
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


TICK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid):
    """CPU time (user and system, in clock ticks) so far of `pid` and each
    of its descendants (the kernel, and for rvisor its zygotes and
    workers), by pid, from /proc."""
    stats, children = {}, {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(p)] = int(fields[11]) + int(fields[12])
        children.setdefault(int(fields[1]), []).append(int(p))
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        out[p] = stats.get(p, 0)
        todo += children.get(p, [])
    return out


def cpu_since(pid, before):
    """Seconds of CPU the processes of `pid` used since `before` (a process
    that ended meanwhile is not counted; one that began is, whole)."""
    now = cpu_ticks(pid)
    return sum(max(0, t - before.get(p, 0)) for p, t in now.items()) / TICK


def kernel_root(km):
    """The process whose tree runs the kernel's R: for rvisor's kernel its
    kernel host (the bench's own, in RVISOR_KERNEL_HOST_DIR; not a child of
    the stub), else the process jupyter_client started."""
    hosts = os.environ.get("RVISOR_KERNEL_HOST_DIR", "")
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"--host-socket" in argv and any(a.startswith(hosts.encode()) for a in argv if a):
            if km.kernel_name.startswith("rvisor"):
                return int(p)
    return km.provisioner.process.pid


def settle(km, quiet=0.5, limit=20):
    """Waits (at most `limit` s) until the kernel's processes have used no
    CPU for `quiet` s: after a cold start rvisor's kernel host warms its
    zygotes up in the background (the preloaded one once a cell names
    ggplot2), which would otherwise land in the first timed rows. IRkernel
    has nothing running between cells."""
    root = kernel_root(km)
    end = time.monotonic() + limit
    while time.monotonic() < end:
        before = cpu_ticks(root)
        time.sleep(quiet)
        if cpu_since(root, before) * TICK < 1:
            return


def timed(kc, code, reps, want="ok", km=None, cpu=None):
    """Wall times of `reps` runs of `code`; with `km`, the CPU time of the
    kernel's processes per run is appended to `cpu` (less sensitive to a
    loaded machine than wall time; 10 ms ticks, so only plots are given)."""
    out = []
    root = kernel_root(km) if km else None
    before = cpu_ticks(root) if km else {}
    for _ in range(reps):
        t = time.perf_counter()
        r = run(kc, code)
        out.append(time.perf_counter() - t)
        assert r["status"] == want, (code, r)
    if km:
        cpu.append(cpu_since(root, before) / reps)
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


def first_reply(kc, code):
    """Sends one cell; its execute_reply (iopub may miss a kernel that is
    still binding, the shell request waits in libzmq)."""
    msg_id = kc.execute(code)
    deadline = time.monotonic() + TIMEOUT
    while True:
        m = kc.get_shell_msg(timeout=deadline - time.monotonic())
        if m["parent_header"].get("msg_id") == msg_id:
            return m["content"]


def restart_kernel_part(name, reps):
    """shutdown_request to the new kernel's first reply, without the
    client's own waits (see the module's doc)."""
    km = KernelManager(kernel_name=name)
    km.context.setsockopt(zmq.RECONNECT_IVL, 1)
    km.start_kernel()
    kc = km.client()
    kc.context.setsockopt(zmq.RECONNECT_IVL, 1)
    kc.start_channels()
    kc.wait_for_ready(timeout=TIMEOUT)
    out = []
    try:
        for _ in range(reps):
            t = time.perf_counter()
            km.request_shutdown(restart=True)
            km.provisioner.process.wait(timeout=TIMEOUT)
            km.cleanup_resources(restart=True)
            km.start_kernel(**km._launch_args)
            assert first_reply(kc, "1+1")["status"] == "ok"
            out.append(time.perf_counter() - t)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    return out


def cold_starts(name, n):
    """Starts with nothing running: IRkernel's every start; rvisor's with a
    kernel host directory of their own each, so each starts its host (a
    new supervisor). Each host is waited for to exit (its idle time) before
    the next start, so none runs its zygotes' warm-up beside another."""
    out = []
    hosts = os.environ["RVISOR_KERNEL_HOST_DIR"]
    try:
        for k in range(n):
            own = os.path.join(os.path.dirname(hosts), "cold", str(k))
            if name == "rvisor":
                os.environ["RVISOR_KERNEL_HOST_DIR"] = own
            km, kc, took = start(name)
            out.append(took)
            kc.stop_channels()
            km.shutdown_kernel(now=False)
            deadline = time.monotonic() + TIMEOUT
            while name == "rvisor" and any(f.endswith(".sock") for f in os.listdir(own)):
                assert time.monotonic() < deadline, "the cold start's kernel host did not exit"
                time.sleep(0.2)
    finally:
        os.environ["RVISOR_KERNEL_HOST_DIR"] = hosts
    return out


def bench(name, reps, cpus):
    rows = {}
    # The first starts: nothing running (rvisor's starts its kernel host:
    # a new supervisor, its zygotes warming up meanwhile); the later ones
    # are timed after the cells below, as a notebook's restarts come.
    rows["first start to result"] = cold_starts(name, 3)
    km, kc, _ = start(name)
    try:
        run(kc, "x <- 1; library(ggplot2); d <- data.frame(a = 1:100, b = rnorm(100))")
        run(kc, "plot(1)")
        settle(km)
        rows["1+1"] = timed(kc, "1+1", reps)
        rows["error"] = timed(kc, "stop('no')", reps, want="error")
        rows["base plot"] = timed(kc, "plot(1:10)", max(5, reps // 2), km=km,
                                  cpu=cpus.setdefault("base plot", []))
        rows["ggplot"] = timed(kc, "print(ggplot(d, aes(a, b)) + geom_point())",
                               max(5, reps // 2), km=km, cpu=cpus.setdefault("ggplot", []))
        rows["interrupt repeat {}"] = interrupt(km, kc, max(3, reps // 10))
        rows["restart to first result"] = restart(km, kc, max(2, reps // 10))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    starts = []
    for _ in range(max(2, reps // 5)):
        km, kc, took = start(name)
        starts.append(took)
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    rows["start to first result"] = starts
    rows["restart, kernel's part"] = restart_kernel_part(name, max(3, reps // 3))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rvisor", default="target/release/rvisor")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", action="store_true")
    p.add_argument("flags", nargs="*")
    a = p.parse_args()
    flags = a.flags
    if not any(f.startswith("--host-idle-secs") for f in flags):
        flags = flags + ["--host-idle-secs", "10"]  # the bench's host goes soon after it
    prefix = specs(os.path.abspath(a.rvisor), flags)
    try:
        cpu = {"rvisor": {}, "ir": {}}
        result = {name: bench(name, a.reps, cpu[name]) for name in ["rvisor", "ir"]}
    finally:
        shutil.rmtree(prefix, ignore_errors=True)
    med = {k: {row: statistics.median(v) * 1000 for row, v in rows.items()}
           for k, rows in result.items()}
    if a.json:
        print(json.dumps({"median_ms": med, "samples": {k: {r: len(v) for r, v in rows.items()}
                                                         for k, rows in result.items()},
                          "cpu_ms_per_cell": {k: {r: v[0] * 1000 for r, v in rows.items()}
                                              for k, rows in cpu.items()}}))
        return
    print(f"{'row (median ms)':28} {'rvisor':>10} {'IRkernel':>10} {'ratio':>7}")
    for row in med["rvisor"]:
        r, i = med["rvisor"][row], med["ir"][row]
        print(f"{row:28} {r:10.1f} {i:10.1f} {r / i:7.2f}  (n={len(result['rvisor'][row])})")
    print("CPU per cell (ms; the kernel's processes, all of them)")
    for row in cpu["rvisor"]:
        r, i = cpu["rvisor"][row][0] * 1000, cpu["ir"][row][0] * 1000
        print(f"{row:28} {r:10.1f} {i:10.1f} {r / i:7.2f}")


if __name__ == "__main__":
    main()

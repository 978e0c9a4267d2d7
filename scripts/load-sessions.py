#!/usr/bin/env python3
"""Load test of durable sessions under admission control (issue 15).

Starts `rvisor serve` with a state directory and a live-session cap, opens
N sessions, gives each ~5 MB of distinct state, then has several clients
call every session again (in shuffled order) and check that its state came
back intact. Admission hibernates the least recently used idle sessions to
keep at most `--live` workers; a refusal (429/503) is retried after its
Retry-After. A sampler reads /v1/health every 0.25 s for the live sessions
and the workers' memory.

Prints one JSON summary: sessions, failures, retries, the most live
sessions and the peak workers' memory seen against the cap and the budget,
and call latencies (median, p95) of both phases.

    scripts/load-sessions.py --sessions 1000 --live 50 --clients 4

Standard library only. The target (issue 15): 1,000 sessions of ~5 MB, at
most 50 live, every session answers with its state, workers' memory within
the budget.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request


def call(base, method, path, body=None, timeout=300):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null"), None
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            payload = json.loads(text)
        except ValueError:
            payload = {"raw": text.decode(errors="replace")}
        return e.code, payload, e.headers.get("Retry-After")


def start_server(args, state, data):
    cmd = [
        args.rvisor, "serve", "--no-auth", "--listen", "127.0.0.1:0",
        "--data-dir", data, "--state-dir", state,
        "--max-live-sessions", str(args.live),
        "--max-live-sessions-per-tenant", str(args.live),
        "--max-sessions-per-tenant", str(args.sessions),
        "--max-sessions", str(args.sessions),
        "--max-calls-per-tenant", "0",
        "--hibernate-after-secs", "0",
    ]
    if args.memory_budget_mb is not None:
        cmd += ["--memory-budget-mb", str(args.memory_budget_mb)]
    if args.unconfined:
        cmd.insert(1, "--unconfined")
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = p.stderr.readline()
        if not line:
            sys.exit("rvisor serve ended before it listened")
        if "listening on http://" in line:
            addr = line.split("listening on http://")[1].strip()
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, "http://" + addr
    sys.exit("rvisor serve did not listen within 120 s")


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.retries = 0
        self.restored = 0
        self.failures = []
        self.lat = {"fill": [], "check": []}

    def add(self, phase, secs):
        with self.lock:
            self.lat[phase].append(secs)


def run_call(base, sid, code, stats, phase):
    """One call, retried on 429/503 after Retry-After; the result."""
    while True:
        t0 = time.perf_counter()
        status, body, retry = call(base, "POST", f"/v1/sessions/{sid}/run", {"code": code})
        if status in (429, 503):
            with stats.lock:
                stats.retries += 1
            time.sleep(float(retry or 1))
            continue
        stats.add(phase, time.perf_counter() - t0)
        return status, body


def fill(i):
    # ~5 MB of doubles, distinct per session.
    return f"set.seed({i}); x <- rnorm(655360); tag <- {i}L; cat(tag, format(sum(x), digits = 15))"


def check(i):
    return "cat(tag, format(sum(x), digits = 15))"


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--live", type=int, default=50)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--memory-budget-mb", type=int, default=None)
    ap.add_argument("--rvisor", default=os.environ.get("RVISOR", "target/release/rvisor"))
    ap.add_argument("--unconfined", action="store_true")
    args = ap.parse_args()

    state = tempfile.mkdtemp(prefix="rvisor-load-state-")
    data = tempfile.mkdtemp(prefix="rvisor-load-data-")
    server, base = start_server(args, state, data)
    stats = Stats()
    peak = {"live": 0, "memory": 0, "hibernated": 0, "measured": None, "budget": None,
            "samples": 0, "over": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            status, h, _ = call(base, "GET", "/v1/health", timeout=30)
            if status == 200:
                a = h["admission"]
                peak["live"] = max(peak["live"], a["live_sessions"])
                peak["memory"] = max(peak["memory"], a["worker_memory_bytes"])
                peak["hibernated"] = max(peak["hibernated"], a["hibernated_sessions"])
                peak["measured"] = a["worker_memory_measured"]
                peak["budget"] = a["memory_budget_bytes"]
                peak["samples"] += 1
                if a["memory_budget_bytes"] is not None and \
                        a["worker_memory_bytes"] > a["memory_budget_bytes"]:
                    peak["over"] += 1
                if os.environ.get("LOAD_TRACE"):
                    print(json.dumps({k: a[k] for k in ("live_sessions", "worker_memory_bytes",
                                                        "calls_in_flight")}), file=sys.stderr)
            done.wait(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.time()
    try:
        ids = []
        for _ in range(args.sessions):
            status, body, _ = call(base, "POST", "/v1/sessions", {})
            if status != 201:
                sys.exit(f"could not open a session: {status} {body}")
            ids.append(body["id"])
        expected = {}

        def worker(phase, items):
            for i in items:
                sid = ids[i]
                code = fill(i) if phase == "fill" else check(i)
                status, r = run_call(base, sid, code, stats, phase)
                # The last line: a restore puts a notice line before it.
                text = (r or {}).get("console", "") if status == 200 else ""
                out = (text.strip().splitlines() or [""])[-1]
                if status == 200 and (r.get("session") or {}).get("restored"):
                    with stats.lock:
                        stats.restored += 1
                if status != 200 or r.get("outcome") != "complete":
                    with stats.lock:
                        stats.failures.append({"session": i, "phase": phase, "status": status,
                                               "answer": str(r)[:300]})
                    continue
                if phase == "fill":
                    expected[i] = out
                elif expected.get(i) != out:
                    with stats.lock:
                        stats.failures.append({"session": i, "phase": phase,
                                               "want": expected.get(i), "got": out[:300]})

        for phase in ("fill", "check"):
            order = list(range(args.sessions))
            random.shuffle(order)
            slices = [order[k::args.clients] for k in range(args.clients)]
            threads = [threading.Thread(target=worker, args=(phase, s)) for s in slices]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = time.time() - started
    finally:
        done.set()
        sampler.join(timeout=5)
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)

    summary = {
        "sessions": args.sessions,
        "live_cap": args.live,
        "clients": args.clients,
        "failures": len(stats.failures),
        "first_failures": stats.failures[:5],
        "retries_after_429_503": stats.retries,
        "calls_that_restored": stats.restored,
        "max_live_seen": peak["live"],
        "peak_worker_memory_mib": round(peak["memory"] / 2**20, 1),
        "worker_memory_measured": peak["measured"],
        "health_samples": peak["samples"],
        "samples_over_budget": peak["over"],
        "memory_budget_mib": None if peak["budget"] is None else round(peak["budget"] / 2**20),
        "fill_call_ms": {"p50": pct(stats.lat["fill"], 0.5), "p95": pct(stats.lat["fill"], 0.95)},
        "check_call_ms": {"p50": pct(stats.lat["check"], 0.5), "p95": pct(stats.lat["check"], 0.95)},
        "wall_seconds": round(wall, 1),
    }
    print(json.dumps(summary, indent=2))
    ok = not stats.failures and peak["live"] <= args.live and (
        peak["budget"] is None or peak["memory"] <= peak["budget"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

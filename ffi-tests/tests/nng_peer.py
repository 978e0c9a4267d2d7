"""A line-based bridge to an nng REQ/REP server, for ffi-tests/tests/nng.rs.

    python3 nng_peer.py URL

Dials URL with a pynng REQ socket. Every line read from stdin is one request,
sent on a REQ context of its own, so several may be in flight at once (a
`cancel` while a `run` runs); every reply is printed as one line on stdout
as it arrives. A line {"_raw": "TEXT"} sends TEXT as is (for requests that
are not JSON). If a request gets no reply, the line printed is
{"_bridge_error": "...", "request": LINE}. On EOF the bridge waits for the
outstanding replies and exits.
"""

import json
import sys
import threading

import pynng

# Longest a reply may take: more than any call of the tests.
RECV_TIMEOUT_MS = 120_000

print_lock = threading.Lock()


def emit(line):
    with print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def payload(line):
    """The bytes to send for one stdin line."""
    try:
        msg = json.loads(line)
    except ValueError:
        return line.encode()
    if isinstance(msg, dict) and set(msg) == {"_raw"}:
        return msg["_raw"].encode()
    return line.encode()


def exchange(sock, line):
    try:
        with sock.new_context() as ctx:
            ctx.send(payload(line))
            reply = ctx.recv().decode("utf-8", "replace")
        # Newlines in JSON are only whitespace (strings escape theirs).
        emit(reply.replace("\n", " "))
    except Exception as e:  # reported to the test, which fails on it
        emit(json.dumps({"_bridge_error": f"{type(e).__name__}: {e}", "request": line}))


def main():
    url = sys.argv[1]
    # recv_max_size=0: no 1 MiB limit (results with plots are larger).
    # resend_time=-1: never resend a request whose reply is slow (a resent
    # run would run twice).
    with pynng.Req0(recv_max_size=0, resend_time=-1, recv_timeout=RECV_TIMEOUT_MS) as sock:
        sock.dial(url, block=True)
        threads = []
        for line in sys.stdin:
            line = line.rstrip("\n")
            if not line:
                continue
            t = threading.Thread(target=exchange, args=(sock, line))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()


if __name__ == "__main__":
    main()

"""End-to-end checks of `rvisor kernel` through jupyter_client and nbclient.

python3 check.py RVISOR_BIN SCENARIO [kernel flags...]: installs the
kernelspec into a private prefix, starts the kernel the way every Jupyter
front end does (jupyter_client's KernelManager), runs SCENARIO and prints
"OK SCENARIO" (a failed check raises, exit code 1). ffi-tests/tests/jupyter.rs
runs each scenario as a test.
"""
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from jupyter_client import KernelManager

TIMEOUT = 60  # seconds any one reply may take (a loaded CI machine)


def install(rvisor, flags):
    prefix = tempfile.mkdtemp(prefix="rvisor-kernelspec-")
    subprocess.run([rvisor, "kernel", "install", "--prefix", prefix, "--"] + flags, check=True)
    os.environ["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter")
    return prefix


def start():
    km = KernelManager(kernel_name="rvisor")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=TIMEOUT)
    return km, kc


def iopub_until_idle(kc, msg_id):
    """The iopub messages of request msg_id, up to its idle status."""
    out = []
    deadline = time.monotonic() + TIMEOUT
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no idle status for {msg_id} within {TIMEOUT}s; got {out}"
        m = kc.get_iopub_msg(timeout=left)
        if m["parent_header"].get("msg_id") != msg_id:
            continue
        out.append(m)
        if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            return out


def shell_reply(kc, msg_id):
    deadline = time.monotonic() + TIMEOUT
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no shell reply to {msg_id} within {TIMEOUT}s"
        m = kc.get_shell_msg(timeout=left)
        if m["parent_header"].get("msg_id") == msg_id:
            return m


def execute(kc, code, **kw):
    """(reply content, [(msg_type, content)]) of one cell."""
    msg_id = kc.execute(code, **kw)
    io = iopub_until_idle(kc, msg_id)
    reply = shell_reply(kc, msg_id)
    return reply["content"], [(m["msg_type"], m["content"]) for m in io]


def text_of(msgs, name):
    return "".join(c["text"] for t, c in msgs if t == "stream" and c["name"] == name)


def result_of(msgs):
    """The text/plain of the cell's execute_result ("" without one); a cell
    has at most one."""
    results = [c for t, c in msgs if t == "execute_result"]
    assert len(results) <= 1, msgs
    return results[0]["data"]["text/plain"] if results else ""


def basics(km, kc):
    msg_id = kc.kernel_info()
    info = shell_reply(kc, msg_id)["content"]
    assert info["status"] == "ok", info
    major, minor = (int(p) for p in info["protocol_version"].split(".")[:2])
    assert (major, minor) >= (5, 3), info
    assert info["language_info"]["name"] == "R", info
    assert info["language_info"]["version"].startswith("4."), info

    reply, msgs = execute(kc, "x <- 41")
    assert reply["status"] == "ok" and reply["execution_count"] == 1, reply
    kinds = [t for t, _ in msgs]
    assert kinds[0] == "status" and msgs[0][1]["execution_state"] == "busy", kinds
    assert kinds[1] == "execute_input" and msgs[1][1]["execution_count"] == 1, msgs
    assert "stream" not in kinds, msgs  # a first cell says nothing about resets

    reply, msgs = execute(kc, "x + 1")
    assert reply["execution_count"] == 2, reply
    assert result_of(msgs) == "[1] 42\n", msgs
    assert text_of(msgs, "stdout") == "", msgs  # the value is the result, once
    result = [c for t, c in msgs if t == "execute_result"][0]
    assert result["execution_count"] == 2, result
    assert result["metadata"]["rvisor"]["kind"] == "value", result

    reply, msgs = execute(kc, "cat('to stdout\\n'); message('to stderr')")
    assert text_of(msgs, "stdout") == "to stdout\n", msgs
    assert text_of(msgs, "stderr") == "to stderr\n", msgs

    reply, msgs = execute(kc, "f <- function() warning('careful'); f(); 'after'")
    assert reply["status"] == "ok", reply
    assert "Warning message:\nIn f() : careful" in text_of(msgs, "stderr"), msgs
    assert result_of(msgs) == '[1] "after"\n', msgs

    reply, msgs = execute(kc, "g <- function() stop('boom'); h <- function() g(); h()")
    assert reply["status"] == "error" and reply["ename"] == "RError", reply
    assert reply["evalue"] == "boom", reply
    errors = [c for t, c in msgs if t == "error"]
    assert len(errors) == 1, msgs
    tb = "\n".join(errors[0]["traceback"])
    assert "Error in g() : boom" in tb and "h()" in tb, tb

    reply, msgs = execute(kc, "plot(1:10)")
    shown = [c for t, c in msgs if t == "display_data"]
    assert len(shown) == 1, msgs
    png = base64.b64decode(shown[0]["data"]["image/png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n", png[:8]
    assert shown[0]["metadata"]["image/png"]["width"] > 0, shown[0]

    # Parent header correlation: everything on iopub from here to the
    # cell's idle belongs to the cell (nothing else runs meanwhile).
    msg_id = kc.execute("cat('a\\n'); plot(2)")
    seen = []
    while not (seen and seen[-1]["msg_type"] == "status"
               and seen[-1]["content"]["execution_state"] == "idle"):
        seen.append(kc.get_iopub_msg(timeout=TIMEOUT))
    assert all(m["parent_header"]["msg_id"] == msg_id for m in seen), seen
    assert {"execute_input", "stream", "display_data"} <= {m["msg_type"] for m in seen}, seen
    shell_reply(kc, msg_id)

    # Parse errors: nothing runs.
    reply, _ = execute(kc, "x <- ")
    assert reply["status"] == "error" and reply["ename"] == "ParseError", reply

    # store_history=False: no new count; silent: no outputs at all.
    before = reply["execution_count"]
    reply, msgs = execute(kc, "x", store_history=False)
    assert reply["execution_count"] == before, reply
    reply, msgs = execute(kc, "print(x); plot(1)", silent=True)
    assert [t for t, _ in msgs] == ["status", "status"], msgs
    assert reply["execution_count"] == before, reply

    # stop_on_error: a cell queued behind a failing one is aborted. Both
    # are sent while a cell that waits for input holds the shell loop, so
    # both have arrived before the failing one runs (sent back to back
    # after an idle kernel, the second may come after the first's reply,
    # and is then rightly run).
    gate = kc.execute("readline('go? ')", allow_stdin=True)
    get_input_request(kc)
    first = kc.execute("stop('first')")
    second = kc.execute("z <- 1")
    kc.input("go")
    assert shell_reply(kc, gate)["content"]["status"] == "ok"
    assert shell_reply(kc, first)["content"]["status"] == "error"
    assert shell_reply(kc, second)["content"]["status"] == "aborted"
    reply, msgs = execute(kc, "exists('z')")
    assert result_of(msgs) == "[1] FALSE\n", msgs

    c = shell_reply(kc, kc.complete("y <- rnor", 9))["content"]
    assert "rnorm" in c["matches"] and c["cursor_start"] == 5 and c["cursor_end"] == 9, c
    c = shell_reply(kc, kc.complete("x$", 2))["content"]
    assert c["status"] == "ok", c
    for code, want in [("f <- function(x) {", "incomplete"), ("1 + 1", "complete"),
                       ("x <- )", "invalid"), ('s <- "abc', "incomplete")]:
        c = shell_reply(kc, kc.is_complete(code))["content"]
        assert c["status"] == want, (code, c)
    c = shell_reply(kc, kc.inspect("mean(x)", 2))["content"]
    assert c["found"] and "Arithmetic Mean" in c["data"]["text/plain"], c
    c = shell_reply(kc, kc.inspect("x", 1))["content"]
    assert c["found"] and "num 41" in c["data"]["text/plain"], c
    h = shell_reply(kc, kc.history(hist_access_type="tail", n=2))["content"]
    assert [e[2] for e in h["history"]] == ["stop('first')", "exists('z')"], h
    assert h["history"][0][1] < h["history"][1][1], h
    ci = shell_reply(kc, kc.comm_info())["content"]
    assert ci == {"status": "ok", "comms": {}}, ci
    # kernel_info answers before R is up (the version read from R's
    # installation): the same version the session's R has.
    reply, msgs = execute(kc, "cat(format(getRversion()))", store_history=False)
    assert text_of(msgs, "stdout") == info["language_info"]["version"], (info, msgs)


def values(km, kc):
    """Visible values as displays: the last one the cell's execute_result,
    earlier ones display_data, explicit print() and cat() stream text."""
    reply, msgs = execute(kc, "1\ncat('mid\\n')\n2\ninvisible(3)")
    assert reply["status"] == "ok", reply
    kinds = [t for t, _ in msgs if t not in ("status", "execute_input")]
    assert kinds == ["display_data", "stream", "execute_result"], msgs  # in order
    assert text_of(msgs, "stdout") == "mid\n", msgs
    first = [c for t, c in msgs if t == "display_data"][0]
    assert first["data"]["text/plain"] == "[1] 1\n", first
    assert first["metadata"]["rvisor"]["kind"] == "value", first
    assert "last" not in first["metadata"]["rvisor"], first
    assert result_of(msgs) == "[1] 2\n", msgs
    # The last visible value, even with an assignment after it.
    reply, msgs = execute(kc, "5\ny <- 1")
    assert result_of(msgs) == "[1] 5\n", msgs
    # print() is output, not a value; invisible() shows nothing.
    reply, msgs = execute(kc, "print('p'); invisible(7)")
    assert text_of(msgs, "stdout") == '[1] "p"\n' and result_of(msgs) == "", msgs
    # Exactly as R prints it: a list, a function, a long vector.
    for code in ["list(a = 1, b = 'x')", "function(x) x + 1", "1:30", "'caf\u00e9'"]:
        reply, msgs = execute(kc, f"v <- {code}; v")
        want = execute(kc, "cat(paste0(capture.output(print(v)), '\\n'), sep = '')")[1]
        assert result_of(msgs) == text_of(want, "stdout"), (code, msgs, want)
    # A data frame: once, as a table with its text.
    reply, msgs = execute(kc, "data.frame(a = 1:2)")
    assert text_of(msgs, "stdout") == "", msgs
    res = [c for t, c in msgs if t == "execute_result"][0]
    assert "<table" in res["data"]["text/html"], res
    assert res["data"]["text/plain"] == "  a\n1 1\n2 2\n", res
    assert res["metadata"]["rvisor"]["kind"] == "table", res
    # A print method that fails: what it printed, then the error.
    reply, msgs = execute(kc, "print.bad <- function(x, ...) { cat('partial\\n'); "
                              "stop('no print') }\nstructure(1, class = 'bad')")
    assert reply["status"] == "error" and reply["evalue"] == "no print", reply
    assert text_of(msgs, "stdout") == "partial\n" and result_of(msgs) == "", msgs
    # A value and a plot: the plot is display_data, the value the result.
    reply, msgs = execute(kc, "plot(1)\n42")
    assert result_of(msgs) == "[1] 42\n", msgs
    assert any("image/png" in c["data"] for t, c in msgs if t == "display_data"), msgs
    shown = [t for t, _ in msgs if t in ("display_data", "execute_result")]
    assert shown == ["display_data", "execute_result"], msgs  # the result last


def runs(msgs):
    """The cell's outputs, consecutive stream messages of one name joined
    (R may write a line in pieces): [(msg_type, content)]."""
    out = []
    for t, c in msgs:
        if t in ("status", "execute_input"):
            continue
        if t == "stream" and out and out[-1][0] == "stream" and out[-1][1]["name"] == c["name"]:
            out[-1] = ("stream", {"name": c["name"], "text": out[-1][1]["text"] + c["text"]})
        else:
            out.append((t, c))
    return out


def ordered(km, kc):
    """Displays come where they were made, between the stream text (each
    sent as its event arrives), and the last visible value is the result."""
    reply, msgs = execute(kc, 'cat("before\\n"); head(mtcars); cat("after\\n"); 1+1')
    assert reply["status"] == "ok", reply
    shown = runs(msgs)
    assert [t for t, _ in shown] == ["stream", "display_data", "stream", "execute_result"], msgs
    assert shown[0][1] == {"name": "stdout", "text": "before\n"}, shown[0]
    table = shown[1][1]
    assert "<table" in table["data"]["text/html"], table
    assert "Mazda RX4" in table["data"]["text/plain"], table
    assert "last" not in table["metadata"]["rvisor"], table
    assert table["metadata"]["rvisor"]["value"] is True, table
    assert shown[2][1] == {"name": "stdout", "text": "after\n"}, shown[2]
    assert result_of(msgs) == "[1] 2\n", msgs
    # print() is output: its text in order with the rest.
    reply, msgs = execute(kc, 'cat("a\\n"); print(head(mtcars, 1)); rvisor_display(head(mtcars, 2)); '
                              'cat("b\\n")')
    shown = runs(msgs)
    assert [t for t, _ in shown] == ["stream", "display_data", "stream"], msgs
    assert shown[0][1]["text"].startswith("a\n") and "Mazda RX4" in shown[0][1]["text"], shown
    assert "Mazda RX4 Wag" in shown[1][1]["data"]["text/html"], shown[1]
    assert shown[2][1]["text"] == "b\n", shown
    # A plot page's display comes at the end of the call, the value last.
    reply, msgs = execute(kc, 'cat("a\\n"); plot(1); cat("b\\n"); 3')
    shown = [t for t, _ in runs(msgs)]
    assert shown == ["stream", "display_data", "execute_result"], msgs
    assert text_of(msgs, "stdout") == "a\nb\n", msgs
    assert result_of(msgs) == "[1] 3\n", msgs
    # A page finished while the cell runs (the next one began) comes then,
    # between the text before and after it; the last page at the end.
    reply, msgs = execute(kc, 'cat("a\\n"); plot(1); cat("b\\n"); plot(2); cat("c\\n"); 4')
    shown = runs(msgs)
    assert [t for t, _ in shown] == ["stream", "display_data", "stream", "display_data",
                                     "execute_result"], msgs
    assert shown[0][1]["text"] == "a\nb\n" and shown[2][1]["text"] == "c\n", shown
    assert all("image/png" in shown[i][1]["data"] for i in (1, 3)), shown
    assert result_of(msgs) == "[1] 4\n", msgs
    # rvisor_display() is sent at once, while the cell runs: this one
    # never ends by itself, so its display must come before the interrupt.
    msg_id = kc.execute("rvisor_display(head(mtcars, 3)); repeat {}")
    deadline = time.monotonic() + TIMEOUT
    while True:
        m = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "display_data":
            break
    assert "Valiant" not in m["content"]["data"]["text/html"], m  # 3 rows
    assert "Datsun 710" in m["content"]["data"]["text/html"], m
    km.interrupt_kernel()
    reply = shell_reply(kc, msg_id)["content"]
    assert reply["status"] == "error" and reply["ename"] == "Interrupted", reply
    rest = [m["msg_type"] for m in iopub_until_idle(kc, msg_id)]
    assert "display_data" not in rest, rest  # not again from the result
    # A silent cell sends nothing.
    reply, msgs = execute(kc, 'cat("x\\n"); head(mtcars); 1', silent=True)
    assert reply["status"] == "ok", reply
    assert [t for t, _ in msgs if t != "status"] == [], msgs


def display_ids(km, kc):
    """rvisor_display(x, display_id =): display_data with transient.display_id;
    update = TRUE: update_display_data of that id, in the same cell or a
    later one; a table keeps its bundle; without an id nothing changes."""
    reply, msgs = execute(kc, "rvisor_display('starting', display_id = 'status')\n"
                              "rvisor_display('halfway', display_id = 'status', update = TRUE)")
    assert reply["status"] == "ok", reply
    shown = [(t, c) for t, c in msgs if t in ("display_data", "update_display_data",
                                             "execute_result", "stream")]
    assert [t for t, _ in shown] == ["display_data", "update_display_data"], msgs
    first, update = shown[0][1], shown[1][1]
    assert first["transient"] == {"display_id": "status"}, first
    assert first["data"]["text/plain"] == '[1] "starting"\n', first
    assert update["transient"] == {"display_id": "status"}, update
    assert update["data"]["text/plain"] == '[1] "halfway"\n', update
    # A later cell updates it too; a table keeps its HTML.
    reply, msgs = execute(kc, "rvisor_display(data.frame(done = TRUE), display_id = 'status', "
                              "update = TRUE)")
    assert reply["status"] == "ok", reply
    updates = [c for t, c in msgs if t == "update_display_data"]
    assert len(updates) == 1 and updates[0]["transient"] == {"display_id": "status"}, msgs
    assert "<table" in updates[0]["data"]["text/html"], updates
    assert not [t for t, _ in msgs if t == "display_data"], msgs
    # Two ids apart; without an id a value prints as before, with no transient id.
    reply, msgs = execute(kc, "rvisor_display(1, display_id = 'a'); "
                              "rvisor_display(2, display_id = 'b'); rvisor_display(3)")
    ids = [c["transient"].get("display_id") for t, c in msgs if t == "display_data"]
    assert ids == ["a", "b"], msgs
    assert text_of(msgs, "stdout") == "[1] 3\n", msgs
    # Bad arguments are the cell's error.
    reply, msgs = execute(kc, "rvisor_display(1, update = TRUE)")
    assert reply["status"] == "error" and "display_id" in reply["evalue"], reply
    reply, msgs = execute(kc, "rvisor_display(1, display_id = c('a', 'b'))")
    assert reply["status"] == "error" and "display_id" in reply["evalue"], reply


def get_input_request(kc):
    m = kc.get_stdin_msg(timeout=TIMEOUT)
    assert m["msg_type"] == "input_request", m
    return m["content"]


def input(km, kc):
    """readline(), menu() and askYesNo() ask through input_request when
    the front end allows stdin; without it they fail saying why; an
    interrupt ends a cell that waits for input, state kept."""
    msg_id = kc.execute("name <- readline('Your name: '); cat('hi', name, '\\n')",
                        allow_stdin=True)
    req = get_input_request(kc)
    assert req == {"prompt": "Your name: ", "password": False}, req
    kc.input("Ada")
    msgs = [(m["msg_type"], m["content"]) for m in iopub_until_idle(kc, msg_id)]
    assert shell_reply(kc, msg_id)["content"]["status"] == "ok"
    assert text_of(msgs, "stdout") == "hi Ada \n", msgs

    msg_id = kc.execute("menu(c('apple', 'pear'), title = 'Fruit')", allow_stdin=True)
    assert get_input_request(kc)["prompt"] == "Selection: "
    kc.input("pear")
    msgs = [(m["msg_type"], m["content"]) for m in iopub_until_idle(kc, msg_id)]
    assert "1: apple\n2: pear" in text_of(msgs, "stdout"), msgs
    assert result_of(msgs) == "[1] 2\n", msgs
    shell_reply(kc, msg_id)

    msg_id = kc.execute("askYesNo('Go on?')", allow_stdin=True)
    assert get_input_request(kc)["prompt"].startswith("Go on? (Yes/no/cancel)")
    kc.input("n")
    msgs = [(m["msg_type"], m["content"]) for m in iopub_until_idle(kc, msg_id)]
    assert result_of(msgs) == "[1] FALSE\n", msgs
    shell_reply(kc, msg_id)

    reply, msgs = execute(kc, "readline('? ')", allow_stdin=False)
    assert reply["status"] == "error", reply
    assert "allow_stdin" in reply["evalue"] and "readline()" in reply["evalue"], reply

    # Interrupted while it waits: the cell ends, the state stays, and a
    # late answer goes nowhere.
    msg_id = kc.execute("w <- readline('wait: ')", allow_stdin=True)
    get_input_request(kc)
    km.interrupt_kernel()
    reply = shell_reply(kc, msg_id)["content"]
    assert reply["status"] == "error" and reply["ename"] == "Interrupted", reply
    kc.input("late")
    reply, msgs = execute(kc, "c(name, exists('w'))")
    assert result_of(msgs) == '[1] "Ada"   "FALSE"\n', msgs
    # A new question after the late answer gets its own answer.
    msg_id = kc.execute("readline('again: ')", allow_stdin=True)
    assert get_input_request(kc)["prompt"] == "again: "
    kc.input("fresh")
    msgs = [(m["msg_type"], m["content"]) for m in iopub_until_idle(kc, msg_id)]
    assert result_of(msgs) == '[1] "fresh"\n', msgs
    shell_reply(kc, msg_id)


def input_timeout(km, kc):
    """A pending input does not stop the cell's timeout (the kernel runs
    with --timeout 2): the cell ends TimedOut, the session keeps its
    state."""
    assert execute(kc, "k <- 3")[0]["status"] == "ok"
    msg_id = kc.execute("readline('never answered: ')", allow_stdin=True)
    get_input_request(kc)
    reply = shell_reply(kc, msg_id)["content"]
    assert reply["status"] == "error" and reply["ename"] == "TimedOut", reply
    reply, msgs = execute(kc, "k")
    assert result_of(msgs) == "[1] 3\n", msgs


def interrupt(km, kc):
    assert execute(kc, "x <- 5")[0]["status"] == "ok"
    for how in ["message", "signal"]:
        msg_id = kc.execute("repeat {}")
        # Wait for the cell to run: its execute_input is on iopub.
        deadline = time.monotonic() + TIMEOUT
        while True:
            m = kc.get_iopub_msg(timeout=deadline - time.monotonic())
            if m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "execute_input":
                break
        started = time.monotonic()
        if how == "message":
            km.interrupt_kernel()  # interrupt_mode "message": on control
        else:
            os.kill(km.provisioner.process.pid, signal.SIGINT)
        reply = shell_reply(kc, msg_id)["content"]
        took = time.monotonic() - started
        assert reply["status"] == "error" and reply["ename"] == "Interrupted", (how, reply)
        print(f"interrupt ({how}) answered in {took * 1000:.0f} ms", file=sys.stderr)
        r, msgs = execute(kc, "x")
        assert result_of(msgs) == "[1] 5\n", (how, r, msgs)
        assert "fresh" not in text_of(msgs, "stderr"), (how, msgs)


def restart(km, kc):
    assert execute(kc, "y <- 1")[0]["status"] == "ok"
    km.restart_kernel(now=False)
    kc.wait_for_ready(timeout=TIMEOUT)
    reply, msgs = execute(kc, "exists('y')")
    assert reply["status"] == "ok" and reply["execution_count"] == 1, reply
    assert result_of(msgs) == "[1] FALSE\n", msgs


def crash(km, kc):
    assert execute(kc, "w <- 1")[0]["status"] == "ok"
    reply, msgs = execute(kc, "quit(save = 'no')")
    assert reply["status"] == "error", reply
    assert "the next cell starts in a fresh session" in text_of(msgs, "stderr"), msgs
    reply, msgs = execute(kc, "exists('w')")
    assert reply["status"] == "ok", reply
    assert "fresh R session" in text_of(msgs, "stderr"), msgs
    assert result_of(msgs) == "[1] FALSE\n", msgs


def bad_signature(km, kc):
    """A message signed with another key is never answered (nor run); the
    kernel goes on answering signed ones."""
    import zmq
    from jupyter_client.session import Session

    info = km.get_connection_info()
    # JEP 65: a new iopub subscriber is welcomed (nothing else is sent now).
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://{info['ip']}:{info['iopub_port']}")
    assert sub.poll(TIMEOUT * 1000), "no iopub_welcome"
    welcome = Session(key=info["key"]).deserialize(
        Session(key=info["key"]).feed_identities(sub.recv_multipart())[1])
    assert welcome["msg_type"] == "iopub_welcome", welcome
    assert welcome["content"] == {"subscription": ""}, welcome
    sub.close()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://{info['ip']}:{info['shell_port']}")
    forger = Session(key=b"not-the-key", username="x")
    honest = Session(key=info["key"], username="x")
    bad = forger.send(sock, "execute_request",
                      {"code": "forged <- TRUE", "silent": False, "store_history": True,
                       "user_expressions": {}, "allow_stdin": False})
    good = honest.send(sock, "kernel_info_request", {})
    assert sock.poll(TIMEOUT * 1000), "no reply to the signed request"
    idents, parts = honest.feed_identities(sock.recv_multipart())
    reply = honest.deserialize(parts)
    assert reply["parent_header"]["msg_id"] == good["header"]["msg_id"], reply
    assert reply["parent_header"]["msg_id"] != bad["header"]["msg_id"]
    reply, msgs = execute(kc, "exists('forged')")
    assert result_of(msgs) == "[1] FALSE\n", msgs


def notebook(km, kc):
    import nbformat
    from nbclient import NotebookClient

    kc.stop_channels()
    km.shutdown_kernel()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in [
        "x <- 2",
        "cat(x * 21, '\\n')",
        "plot(1:10, main = 'ten')",
        "df <- data.frame(a = 1:3, b = letters[1:3]); df",
        "warning('careful')",
        "stop('on purpose')",
        "x + 1",
    ]]
    client = NotebookClient(nb, kernel_name="rvisor", timeout=TIMEOUT, allow_errors=True)
    client.execute()
    outs = [c.outputs for c in nb.cells]
    assert "".join(o["text"] for o in outs[1]) == "42 \n", outs[1]
    assert "image/png" in outs[2][0]["data"], outs[2]
    # The data frame once: as the cell's result (HTML and its text), not
    # also as streamed text.
    assert [o["output_type"] for o in outs[3]] == ["execute_result"], outs[3]
    frame = outs[3][0]["data"]
    assert "<table" in frame["text/html"], outs[3]
    assert "a b" in frame["text/plain"] and "3 3 c" in frame["text/plain"], outs[3]
    assert "careful" in outs[4][0]["text"] and outs[4][0]["name"] == "stderr", outs[4]
    # An error: the cell's error output; the notebook goes on, state kept.
    assert outs[5][0]["output_type"] == "error" and outs[5][0]["evalue"] == "on purpose", outs[5]
    assert outs[6][0]["data"]["text/plain"] == "[1] 3\n", outs[6]


def notebook_widget(km, kc):
    """nbclient runs a cell whose value is an htmlwidget (DT): it comes as
    self-contained HTML (scripts inlined, nothing fetched)."""
    import nbformat
    from nbclient import NotebookClient

    kc.stop_channels()
    km.shutdown_kernel()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("DT::datatable(head(mtcars, 3))")]
    NotebookClient(nb, kernel_name="rvisor", timeout=TIMEOUT).execute()
    outs = nb.cells[0].outputs
    widget = [o for o in outs if "text/html" in o.get("data", {})]
    assert len(widget) == 1, outs
    html = widget[0]["data"]["text/html"]
    assert "htmlwidget" in html and "Mazda RX4" in html, html[:500]
    assert "<script" in html and 'src="http' not in html, html[:500]
    # No program was refused on the way (jQuery's version without dpkg).
    text = "".join(o.get("text", "") for o in outs if o["output_type"] == "stream")
    assert "not run" not in text, text


def kernelspec(km, kc):
    out = subprocess.run(["jupyter", "kernelspec", "list", "--json"], check=True,
                         capture_output=True, text=True).stdout
    specs = json.loads(out)["kernelspecs"]
    assert "rvisor" in specs, specs
    spec = specs["rvisor"]["spec"]
    assert spec["language"] == "R" and spec["interrupt_mode"] == "message", spec
    assert os.path.exists(os.path.join(specs["rvisor"]["resource_dir"], "logo-32x32.png"))


def port_free(port):
    import socket
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def wait_for(what, check):
    """Waits (bounded) until check() holds: state a test observes."""
    deadline = time.monotonic() + TIMEOUT
    while not check():
        assert time.monotonic() < deadline, f"not within {TIMEOUT}s: {what}"
        time.sleep(0.05)


def host_sockets():
    d = os.environ["RVISOR_KERNEL_HOST_DIR"]
    return sorted(f for f in os.listdir(d) if f.endswith(".sock"))


def host(km, kc):
    """Kernels of one spec share one kernel host, each in a session of its
    own; a stub killed with SIGKILL ends its kernel (its ports are free
    again) and the other kernel goes on; with no kernel left, the host
    exits after its idle time (--host-idle-secs) and removes its socket."""
    assert len(host_sockets()) == 1, host_sockets()
    assert execute(kc, "x <- 41")[0]["status"] == "ok"
    km2, kc2 = start()
    assert len(host_sockets()) == 1, host_sockets()
    reply, msgs = execute(kc2, "exists('x')")
    assert result_of(msgs) == "[1] FALSE\n", msgs
    assert execute(kc2, "x <- 'other'")[0]["status"] == "ok"
    port = km2.shell_port
    kc2.stop_channels()
    stub = km2.provisioner.process
    stub.kill()  # SIGKILL to the stub: the host must notice alone
    stub.wait()
    wait_for("the killed kernel's shell port is free", lambda: port_free(port))
    reply, msgs = execute(kc, "x + 1")
    assert result_of(msgs) == "[1] 42\n", msgs
    kc.stop_channels()
    km.shutdown_kernel(now=False)
    wait_for("the idle host has removed its socket", lambda: host_sockets() == [])


def kernel_messages(km, kc):
    """A kernel's own messages (here: a forged message refused) go to the
    standard error of the process the front end started (its stub), not
    into the kernel host's log, which kernels share."""
    import zmq
    from jupyter_client.session import Session

    err_path = os.path.join(os.environ["RVISOR_KERNEL_HOST_DIR"] + "-stderr")
    with open(err_path, "w") as err:
        km2 = KernelManager(kernel_name="rvisor")
        km2.start_kernel(stderr=err)
    try:
        kc2 = km2.client()
        kc2.start_channels()
        kc2.wait_for_ready(timeout=TIMEOUT)
        (sock,) = host_sockets()  # the same host as the first kernel's
        info = km2.get_connection_info()
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.connect(f"tcp://{info['ip']}:{info['shell_port']}")
        Session(key=b"not-the-key", username="x").send(s, "kernel_info_request", {})
        line = "refused a message on shell whose signature does not match"
        wait_for("the stub's stderr has the kernel's message",
                 lambda: line in open(err_path).read())
        log = os.path.join(os.environ["RVISOR_KERNEL_HOST_DIR"], sock[:-len(".sock")] + ".log")
        assert line not in open(log).read(), open(log).read()
        s.close()
        assert execute(kc2, "1")[0]["status"] == "ok"
        kc2.stop_channels()
    finally:
        km2.shutdown_kernel(now=False)
        os.remove(err_path)


def established(port):
    """Whether a TCP connection to this machine's `port` is established
    (accepted by the kernel, or waiting in its listener's backlog)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            if int(local.rsplit(":", 1)[1], 16) == port and state == "01":
                return True
    return False


def early_ports(km, kc):
    """The stub listens on the kernel's ports before its kernel host is up
    (and hands them to the host), so a front end that connects at once is
    served without waiting for its reconnect interval: here one that never
    reconnects (RECONNECT_IVL -1) connects while the host cannot start (the
    test holds the lock a stub takes to start it), and gets its answers."""
    import fcntl
    import zmq
    (sock,) = host_sockets()
    lock_path = os.path.join(os.environ["RVISOR_KERNEL_HOST_DIR"], sock[:-len(".sock")] + ".lock")
    kc.stop_channels()
    km.shutdown_kernel(now=False)
    wait_for("the idle host has removed its socket", lambda: host_sockets() == [])
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        km2 = KernelManager(kernel_name="rvisor")
        km2.start_kernel()
        try:
            port = km2.shell_port
            wait_for("the stub listens on the shell port", lambda: not port_free(port))
            assert host_sockets() == [], "no host can start while the test holds the lock"
            kc2 = km2.client()
            kc2.context.setsockopt(zmq.RECONNECT_IVL, -1)
            kc2.start_channels()
            msg_id = kc2.kernel_info()
            wait_for("the client's connection is established", lambda: established(port))
            assert host_sockets() == [], host_sockets()
            fcntl.flock(lock, fcntl.LOCK_UN)
            info = shell_reply(kc2, msg_id)["content"]
            assert info["status"] == "ok" and info["language_info"]["name"] == "R", info
            reply, msgs = execute(kc2, "6 * 7")
            assert result_of(msgs) == "[1] 42\n", msgs
            assert len(host_sockets()) == 1, host_sockets()
            kc2.stop_channels()
        finally:
            km2.shutdown_kernel(now=False)


def main():
    rvisor, scenario, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    if not any(f.startswith("--host-idle-secs") for f in flags):
        # The tests' hosts do not outlive them for the default 10 minutes.
        flags = flags + ["--host-idle-secs", "1"]
    prefix = install(rvisor, flags)
    km, kc = start()
    try:
        globals()[scenario](km, kc)
    finally:
        if done_is_running(km):
            kc.stop_channels()
            km.shutdown_kernel(now=False)
        shutil.rmtree(prefix, ignore_errors=True)
    print(f"OK {scenario}")


def done_is_running(km):
    try:
        return km.is_alive()
    except Exception:
        return False


if __name__ == "__main__":
    main()

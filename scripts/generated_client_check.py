"""Drives a live `rvisor serve` through a client that openapi-python-client
generated from the server's own /v1/openapi.json (scripts/generated-client.sh
generates it and runs this): asserts real answers from R, the token the
document requires where the server requires it, and 401 parsed as the
documented error body. Prints one line per check and a closing count;
exits non-zero at the first that fails.

    python3 generated_client_check.py DIR BASE_URL TOKEN   # DIR holds rvisor_client/
"""

import sys
import typing

directory, base, token = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, directory)

import httpx  # noqa: E402  (a dependency of the generated client)
from rvisor_client import AuthenticatedClient, Client  # noqa: E402
from rvisor_client.api.files import file_delete, file_get, files_list  # noqa: E402
from rvisor_client.api.operations import health, openapi, run, validate  # noqa: E402
from rvisor_client.api.sessions import (  # noqa: E402
    create_session,
    session_delete,
    session_run,
    session_status,
)
from rvisor_client.models import (  # noqa: E402
    ErrorBody,
    FileList,
    Health,
    NewSession,
    RunResult,
    RunScript,
    SessionRun,
    SessionStatus,
    ValidateBody,
    Validation,
)


passed = 0


def check(what, ok, detail=""):
    global passed
    if not ok:
        print(f"generated-client: FAILED: {what}: {detail}", file=sys.stderr)
        print(f"generated-client: {passed} passed, 1 failed")
        sys.exit(1)
    passed += 1
    print(f"generated-client: ok: {what}")


def client_type(fn):
    return typing.get_type_hints(fn)["client"]


# The document said which operations need the token: the generated
# functions of those take only an AuthenticatedClient, the document's own
# takes either.
for fn in (health.sync, validate.sync, run.sync, create_session.sync, session_run.sync):
    check(
        f"{fn.__module__.rsplit('.', 1)[-1]} requires the token",
        client_type(fn) is AuthenticatedClient,
        client_type(fn),
    )
check(
    "openapi.json is public",
    client_type(openapi.sync) != AuthenticatedClient,
    client_type(openapi.sync),
)

# Workers may still be starting: calls wait for them (60 s per request).
timeout = httpx.Timeout(120.0)
c = AuthenticatedClient(base_url=base, token=token, timeout=timeout, raise_on_unexpected_status=True)

anon_doc = openapi.sync_detailed(client=Client(base_url=base, timeout=timeout))
check("GET /v1/openapi.json without a token", anon_doc.status_code == 200, anon_doc.status_code)

h = health.sync(client=c)
check("health", isinstance(h, Health) and h.status == "ok", h)
print(f"generated-client:   R {h.r_version}, rvisor {h.version}")

v = validate.sync(client=c, body=ValidateBody(script="x <- (1 +\n"))
check("validate finds the syntax error", isinstance(v, Validation) and not v.valid, v)
kinds = [p.kind for p in v.problems]
check("  as a syntax problem", "syntax" in kinds, kinds)
ok = validate.sync(client=c, body=ValidateBody(script="x <- 1 + 1\n"))
check("validate passes good code", isinstance(ok, Validation) and ok.valid, ok)

r = run.sync(client=c, body=RunScript(script="1+1"))
check("run 1+1", isinstance(r, RunResult) and r.success, r)
check("  prints [1] 2", r.console.strip() == "[1] 2", repr(r.console))
check("  outcome complete", r.outcome.value == "complete", r.outcome)

s = create_session.sync(client=c, body=NewSession())
check("create a session", isinstance(s, SessionStatus) and s.id, s)
first = session_run.sync(s.id, client=c, body=SessionRun(code="x <- 41"))
check("session call 1: x <- 41", isinstance(first, RunResult) and first.success, first)
second = session_run.sync(s.id, client=c, body=SessionRun(code="x + 1"))
check("session call 2 sees x", isinstance(second, RunResult) and second.console.strip() == "[1] 42",
      repr(getattr(second, "console", second)))
# Files: an upload (the raw bytes, as any HTTP client sends them), R
# reading it, the listing and the download through the generated client.
data = bytes(range(256)) * 8
put = c.get_httpx_client().put(f"/v1/sessions/{s.id}/files/in/data.bin", content=data)
check("upload a file", put.status_code == 201 and put.json()["size"] == len(data), put.text)
seen = session_run.sync(s.id, client=c, body=SessionRun(code="cat(file.size('in/data.bin'))"))
check("  R sees it", isinstance(seen, RunResult) and seen.console == str(len(data)), seen)
listed = files_list.sync(s.id, client=c)
check("list the files", isinstance(listed, FileList) and [f.name for f in listed.files] == ["in/data.bin"], listed)
got = file_get.sync_detailed(s.id, "in/data.bin", client=c)
check("download it byte-identical", got.status_code == 200 and got.content == data, got.status_code)
session_run.sync(s.id, client=c, body=SessionRun(code="invisible(file.symlink('/etc/passwd', 'link'))"))
bad = file_get.sync_detailed(s.id, "link", client=c)
check("a symlink R made is refused: 409", bad.status_code == 409, (bad.status_code, bad.content))
dropped = file_delete.sync_detailed(s.id, "in/data.bin", client=c)
check("delete it", dropped.status_code == 204, dropped.status_code)
st = session_status.sync(s.id, client=c)
check("session status", isinstance(st, SessionStatus) and st.id == s.id, st)
closed = session_delete.sync_detailed(s.id, client=c)
check("close the session", closed.status_code == 204, closed.status_code)
gone = session_run.sync(s.id, client=c, body=SessionRun(code="x"))
check("a closed session is 404, parsed", isinstance(gone, ErrorBody) and gone.error.code.value == "not_found", gone)

# Without the token, or with a wrong one: 401, parsed as the error body.
for label, who in (
    ("no token", Client(base_url=base, timeout=timeout, raise_on_unexpected_status=True)),
    ("a wrong token", AuthenticatedClient(base_url=base, token="not-the-token-0123456789", timeout=timeout,
                                          raise_on_unexpected_status=True)),
):
    for name, call in (
        ("health", lambda: health.sync_detailed(client=who)),
        ("run", lambda: run.sync_detailed(client=who, body=RunScript(script="1+1"))),
        ("create_session", lambda: create_session.sync_detailed(client=who, body=NewSession())),
    ):
        a = call()
        check(
            f"{name} with {label}: 401 unauthorized, parsed",
            a.status_code == 401 and isinstance(a.parsed, ErrorBody) and a.parsed.error.code.value == "unauthorized",
            (a.status_code, a.parsed),
        )

print(f"generated-client: {passed} passed, 0 failed")

// What the browser suites' global set-up and tear-down share (tests/console,
// tests/jupyterlab): a free loopback port, waiting for a server started as
// a process group to answer, and stopping that group. Node built-ins only,
// so each suite requires it by path from its own node_modules tree.
const fs = require("fs");
const net = require("net");

function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.listen(0, "127.0.0.1", () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
    srv.on("error", reject);
  });
}

// Polls `url` until it answers 2xx, `child` exits (an error naming
// `what`) or `deadlineMs` passes (an error too).
async function waitUp(url, child, deadlineMs, what) {
  const end = Date.now() + deadlineMs;
  while (Date.now() < end) {
    if (child.exitCode !== null) throw new Error(`${what} exited (${child.exitCode})`);
    try {
      const r = await fetch(url);
      if (r.ok) return;
    } catch (_) {
      // not listening yet
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`${what} did not answer ${url} within ${deadlineMs} ms`);
}

// Stops the process group whose leader's pid is in the state file `file`
// (SIGTERM, up to 10 s, then SIGKILL) and removes its `tmp` directory.
async function stopGroup(file) {
  if (!fs.existsSync(file)) return;
  const { pid, tmp } = JSON.parse(fs.readFileSync(file, "utf8"));
  try {
    process.kill(-pid, "SIGTERM");
  } catch (_) {
    // already gone
  }
  const end = Date.now() + 10_000;
  while (Date.now() < end) {
    try {
      process.kill(pid, 0);
    } catch (_) {
      break;
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  try {
    process.kill(-pid, "SIGKILL");
  } catch (_) {
    // stopped
  }
  fs.rmSync(tmp, { recursive: true, force: true });
}

module.exports = { freePort, waitUp, stopGroup };

// Starts `rvisor serve` (RVISOR_BIN, default target/debug/rvisor) on a
// free loopback port with a token file of two tenants (alice, bob) and an
// operator (ops), in a fresh data directory; waits until it is ready.
// What the tests need is written to test-results/state.json.
const { spawn } = require("child_process");
const crypto = require("crypto");
const fs = require("fs");
const net = require("net");
const os = require("os");
const path = require("path");

const STATE = path.join(__dirname, "test-results", "state.json");

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

async function waitUp(url, child, deadlineMs) {
  const end = Date.now() + deadlineMs;
  while (Date.now() < end) {
    if (child.exitCode !== null) throw new Error(`rvisor serve exited (${child.exitCode})`);
    try {
      const r = await fetch(url);
      if (r.ok) return;
    } catch (_) {
      // not listening yet
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`rvisor serve did not answer ${url} within ${deadlineMs} ms`);
}

module.exports = async () => {
  const repo = path.resolve(__dirname, "..", "..");
  const rvisor = process.env.RVISOR_BIN || path.join(repo, "target", "debug", "rvisor");
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "rvisor-console-"));
  const tok = () => crypto.randomBytes(16).toString("hex");
  const tokens = { alice: tok(), bob: tok(), ops: tok() };
  fs.writeFileSync(path.join(tmp, "tokens"),
    Object.entries(tokens).map(([tenant, t]) => `${t} ${tenant}\n`).join(""), { mode: 0o600 });
  const port = await freePort();
  fs.mkdirSync(path.dirname(STATE), { recursive: true });
  const log = fs.openSync(path.join(path.dirname(STATE), "serve.log"), "w");
  const child = spawn(rvisor,
    ["--unconfined", "serve", "--listen", `127.0.0.1:${port}`, "--tokens", path.join(tmp, "tokens"),
     "--operator", "ops", "--data-dir", path.join(tmp, "data")],
    { stdio: ["ignore", log, log], detached: true });
  const base = `http://127.0.0.1:${port}`;
  await waitUp(`${base}/readyz`, child, 30_000);
  const artifacts = path.join(repo, "target", "console-artifacts");
  fs.mkdirSync(artifacts, { recursive: true });
  fs.writeFileSync(STATE, JSON.stringify({ pid: child.pid, base, tokens, tmp, artifacts }));
  child.unref();
};

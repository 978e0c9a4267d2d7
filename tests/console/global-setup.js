// Starts `rvisor serve` (RVISOR_BIN, default target/debug/rvisor) on a
// free loopback port with a token file of two tenants (alice, bob) and an
// operator (ops), in a fresh data directory; waits until it is ready.
// What the tests need is written to test-results/state.json.
const { spawn } = require("child_process");
const crypto = require("crypto");
const fs = require("fs");
const os = require("os");
const path = require("path");
const { freePort, waitUp } = require("../browser-lib/processes");

const STATE = path.join(__dirname, "test-results", "state.json");

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
  await waitUp(`${base}/readyz`, child, 30_000, "rvisor serve");
  const artifacts = path.join(repo, "target", "console-artifacts");
  fs.mkdirSync(artifacts, { recursive: true });
  fs.writeFileSync(STATE, JSON.stringify({ pid: child.pid, base, tokens, tmp, artifacts }));
  child.unref();
};

// Starts JupyterLab on loopback with a token, its kernels from a private
// prefix holding only the rvisor kernel's spec (RVISOR_BIN, default
// target/debug/rvisor), in a fresh root directory; waits until its API
// answers. What the tests need is written to state.json.
const { spawn, execFileSync } = require("child_process");
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
    if (child.exitCode !== null) throw new Error(`jupyter lab exited (${child.exitCode})`);
    try {
      const r = await fetch(url);
      if (r.ok) return;
    } catch (_) {
      // not listening yet
    }
    await new Promise((r) => setTimeout(r, 200));
  }
  throw new Error(`JupyterLab did not answer ${url} within ${deadlineMs} ms`);
}

module.exports = async () => {
  const repo = path.resolve(__dirname, "..", "..");
  const rvisor = process.env.RVISOR_BIN || path.join(repo, "target", "debug", "rvisor");
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "rvisor-jupyterlab-"));
  const prefix = path.join(tmp, "prefix");
  const root = path.join(tmp, "root");
  fs.mkdirSync(root);
  execFileSync(rvisor, ["kernel", "install", "--prefix", prefix], { stdio: "inherit" });
  const port = await freePort();
  const token = crypto.randomBytes(16).toString("hex");
  const env = {
    ...process.env,
    JUPYTER_PATH: path.join(prefix, "share", "jupyter"),
    JUPYTER_CONFIG_DIR: path.join(tmp, "config"),
    JUPYTER_DATA_DIR: path.join(tmp, "data"),
    JUPYTER_RUNTIME_DIR: path.join(tmp, "runtime"),
  };
  fs.mkdirSync(path.dirname(STATE), { recursive: true });
  const log = fs.openSync(path.join(path.dirname(STATE), "jupyterlab.log"), "w");
  const child = spawn(
    "jupyter",
    ["lab", "--no-browser", "--ip=127.0.0.1", `--port=${port}`,
     `--IdentityProvider.token=${token}`, `--ServerApp.root_dir=${root}`,
     // A CI container runs as root.
     ...(process.getuid && process.getuid() === 0 ? ["--allow-root"] : []),
     "--KernelSpecManager.ensure_native_kernel=False", "--LabApp.news_url=",
     "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
    { env, stdio: ["ignore", log, log], detached: true },
  );
  const base = `http://127.0.0.1:${port}`;
  await waitUp(`${base}/api/status?token=${token}`, child, 60_000);
  fs.writeFileSync(STATE, JSON.stringify({ pid: child.pid, base, token, tmp }));
  child.unref();
};

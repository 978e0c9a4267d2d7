// Starts JupyterLab on loopback with a token, its kernels from a private
// prefix holding only the rvisor kernel's spec (RVISOR_BIN, default
// target/debug/rvisor), in a fresh root directory; waits until its API
// answers. What the tests need is written to state.json.
const { spawn, execFileSync } = require("child_process");
const crypto = require("crypto");
const fs = require("fs");
const os = require("os");
const path = require("path");
const { freePort, waitUp } = require("../browser-lib/processes");

const STATE = path.join(__dirname, "test-results", "state.json");

module.exports = async () => {
  const repo = path.resolve(__dirname, "..", "..");
  const rvisor = process.env.RVISOR_BIN || path.join(repo, "target", "debug", "rvisor");
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "rvisor-jupyterlab-"));
  const prefix = path.join(tmp, "prefix");
  const root = path.join(tmp, "root");
  fs.mkdirSync(root);
  // Its kernel host goes soon after the test (not after the default 10 min).
  execFileSync(rvisor, ["kernel", "install", "--prefix", prefix, "--", "--host-idle-secs", "5"],
    { stdio: "inherit" });
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
  await waitUp(`${base}/api/status?token=${token}`, child, 60_000, "JupyterLab");
  fs.writeFileSync(STATE, JSON.stringify({ pid: child.pid, base, token, tmp }));
  child.unref();
};

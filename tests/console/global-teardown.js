// Stops the rvisor serve global-setup.js started (its process group:
// the server and its workers) and removes its directory.
const fs = require("fs");
const path = require("path");

module.exports = async () => {
  const file = path.join(__dirname, "test-results", "state.json");
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
};

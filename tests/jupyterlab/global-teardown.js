// Stops the JupyterLab global-setup.js started (its process group: the
// server and the kernels it started) and removes its directory.
const path = require("path");
const { stopGroup } = require("../browser-lib/processes");

module.exports = () => stopGroup(path.join(__dirname, "test-results", "state.json"));

// Stops the rvisor serve global-setup.js started (its process group:
// the server and its workers) and removes its directory.
const path = require("path");
const { stopGroup } = require("../browser-lib/processes");

module.exports = () => stopGroup(path.join(__dirname, "test-results", "state.json"));

// Playwright against a real `rvisor serve` on loopback (global-setup.js
// starts it with two tenants' tokens and an operator's), with Debian's
// Chromium, headless. Run by scripts/console-tests.sh. Screenshots of
// each page go to target/console-artifacts/.
const { defineConfig } = require("@playwright/test");
const path = require("path");

module.exports = defineConfig({
  testDir: __dirname,
  testMatch: /.*\.spec\.js/,
  globalSetup: require.resolve("./global-setup.js"),
  globalTeardown: require.resolve("./global-teardown.js"),
  fullyParallel: false,
  workers: 1,
  retries: 0,
  timeout: 60_000,
  expect: { timeout: 20_000 },
  reporter: [["list"]],
  outputDir: path.join(__dirname, "test-results"),
  use: {
    headless: true,
    viewport: { width: 1280, height: 900 },
    acceptDownloads: true,
    launchOptions: {
      executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
      args: ["--no-sandbox", "--disable-dev-shm-usage"],
    },
  },
});

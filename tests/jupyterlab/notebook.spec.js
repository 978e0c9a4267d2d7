// A notebook with the rvisor kernel in a real JupyterLab: the cell prints,
// plots and ends with a value; the test waits for each output to appear in
// the page (the text, the PNG image, the execute_result) and takes a
// screenshot (test-results/rvisor-notebook.png).
const { test, expect } = require("@playwright/test");
const fs = require("fs");
const path = require("path");

const state = () =>
  JSON.parse(fs.readFileSync(path.join(__dirname, "test-results", "state.json"), "utf8"));

const CODE = 'cat("hello from rvisor\\n")\nplot(1:10, main = "rvisor plot")\n6 * 7';

test("a cell prints, plots and shows its value", async ({ page, request }) => {
  const { base, token } = state();
  const auth = { Authorization: `token ${token}` };
  // The notebook, made through the server's contents API, names the
  // kernel, so JupyterLab starts it on opening.
  const nb = {
    type: "notebook",
    content: {
      nbformat: 4,
      nbformat_minor: 5,
      metadata: {
        kernelspec: { name: "rvisor", display_name: "R (rvisor)", language: "R" },
        language_info: { name: "R" },
      },
      cells: [{ cell_type: "code", id: "c1", source: CODE, metadata: {}, outputs: [],
                execution_count: null }],
    },
  };
  const put = await request.put(`${base}/api/contents/rvisor.ipynb`, { headers: auth, data: nb });
  expect(put.ok()).toBeTruthy();

  await page.goto(`${base}/lab/tree/rvisor.ipynb?token=${token}`);
  // The kernel is up when the toolbar names it and says it is idle.
  await expect(page.locator(".jp-Notebook")).toBeVisible();
  await expect(page.locator(".jp-KernelName").first()).toContainText("R (rvisor)");
  await expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first())
    .toBeAttached();

  const cell = page.locator(".jp-CodeCell").first();
  await cell.locator(".jp-InputArea-editor").click();
  await page.keyboard.press("Shift+Enter");

  const outputs = cell.locator(".jp-OutputArea");
  await expect(outputs.locator(".jp-RenderedText").first()).toContainText("hello from rvisor");
  const img = outputs.locator("img");
  await expect(img).toHaveCount(1);
  await expect(img).toHaveAttribute("src", /^data:image\/png;base64,/);
  // The image decoded and laid out (naturalWidth is 0 until it has).
  await expect.poll(() => img.evaluate((i) => i.complete && i.naturalWidth)).toBeGreaterThan(0);
  const result = outputs.locator(".jp-OutputArea-executeResult");
  await expect(result).toContainText("[1] 42");
  await expect(cell.locator(".jp-InputPrompt")).toContainText("[1]");

  await page.screenshot({ path: path.join(__dirname, "test-results", "rvisor-notebook.png"),
                          fullPage: true });

  // The kernel goes away with the notebook's session.
  const sessions = await (await request.get(`${base}/api/sessions`, { headers: auth })).json();
  expect(sessions.map((s) => s.kernel.name)).toContain("rvisor");
});

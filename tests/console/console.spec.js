// The web console (/ui/) in headless Chromium against a real rvisor serve
// (global-setup.js): sign in with a tenant token, watch another client's
// call live, see a plot, a data-frame table and an HTML display, download
// a file, cancel a call, and check the security model: a second tenant
// sees none of it, and a script in an HTML display can read neither the
// console's token nor its DOM. Every wait is on a condition (Playwright's
// expect polls with a bounded timeout). Screenshots: target/console-artifacts/.
const { test, expect } = require("@playwright/test");
const fs = require("fs");
const path = require("path");

const state = () => JSON.parse(fs.readFileSync(path.join(__dirname, "test-results", "state.json"), "utf8"));

async function api(method, route, token, body) {
  const { base } = state();
  const r = await fetch(base + route, {
    method,
    headers: { Authorization: `Bearer ${token}`, ...(body ? { "Content-Type": "application/json" } : {}) },
    body: body ? JSON.stringify(body) : undefined,
  });
  const text = await r.text();
  let json = null;
  try { json = JSON.parse(text); } catch (_) { /* not JSON */ }
  return { status: r.status, body: json, headers: r.headers };
}

async function signIn(page, token) {
  const { base } = state();
  await page.goto(`${base}/ui/`);
  await page.locator("#token").fill(token);
  await page.locator("#sign-in").click();
  await expect(page.locator("#sessions")).toBeVisible();
}

const shot = (page, name) => page.screenshot({ path: path.join(state().artifacts, `${name}.png`), fullPage: true });

// One session of alice's, shared by the tests in order.
let sessionId;

test("the console's pages carry a strict CSP and the token never goes in a URL", async ({ page }) => {
  const { base, tokens } = state();
  const r = await fetch(`${base}/ui/`);
  expect(r.status).toBe(200);
  const csp = r.headers.get("content-security-policy");
  expect(csp).toContain("default-src 'none'");
  expect(csp).toContain("script-src 'self'");
  expect(csp).not.toContain("unsafe-inline");
  expect(csp).toContain("frame-ancestors 'none'");
  const frame = await fetch(`${base}/ui/frame.html`);
  expect(frame.headers.get("content-security-policy")).toMatch(/^sandbox allow-scripts;/);
  // A wrong token is refused and not kept.
  await page.goto(`${base}/ui/`);
  await page.locator("#token").fill("not-a-valid-token-at-all");
  await page.locator("#sign-in").click();
  await expect(page.locator(".error")).toContainText("not");
  expect(await page.evaluate(() => sessionStorage.getItem("rvisor-token"))).toBeNull();
  // Requests carry the token in a header only.
  const urls = [];
  page.on("request", (req) => urls.push(req.url()));
  await signIn(page, tokens.alice);
  expect(urls.some((u) => u.includes(tokens.alice))).toBe(false);
  expect((await page.context().cookies()).length).toBe(0);
});

test("a call another client runs shows its output live, and the console cancels it", async ({ page }) => {
  const { tokens } = state();
  const made = await api("POST", "/v1/sessions", tokens.alice);
  expect(made.status).toBe(201);
  sessionId = made.body.id;
  await signIn(page, tokens.alice);
  await expect(page.locator(`tr[data-session="${sessionId}"]`)).toBeVisible();
  await shot(page, "sessions");

  await page.goto(`${state().base}/ui/#/session/${sessionId}`);
  await expect(page.locator("#history")).toContainText("Nothing has run");
  // The page follows the session's calls (its watch stream) from here.
  await expect(page.locator("#live")).toHaveAttribute("data-watching", "1");
  // The agent's call, from another client, not streaming: 30 lines at
  // once (more than status's tail of 20), then a line every 200 ms.
  let finished = false;
  const agent = api("POST", `/v1/sessions/${sessionId}/run`, tokens.alice,
    { code: 'for (i in 1:30) cat("first", i, "\\n"); for (i in 1:200) { cat("tick", i, "\\n"); Sys.sleep(0.2) }' })
    .then((r) => { finished = true; return r; });
  await expect(page.locator("#live")).toContainText("tick 3");
  expect(finished).toBe(false);
  // All of it, not only the last lines.
  await expect(page.locator("#live")).toContainText("first 1 \nfirst 2 \n");
  await expect(page.locator("#status")).toContainText("running");
  await shot(page, "session-live");
  await expect(page.locator("#cancel")).toBeEnabled();
  await page.locator("#cancel").click();
  const r = await agent;
  expect(r.status).toBe(200);
  expect(["interrupted", "cancelled"]).toContain(r.body.outcome);
  const top = page.locator("#history .entry").first();
  await expect(top.locator(".outcome")).toHaveText(r.body.outcome);
  await expect(top).toContainText("tick 3");
  await expect(page.locator("#live")).toBeHidden();
});

test("code run from the console shows a plot, a table once, and a file to download", async ({ page }) => {
  const { tokens } = state();
  await signIn(page, tokens.alice);
  await page.goto(`${state().base}/ui/#/session/${sessionId}`);
  await page.locator("#code").fill(
    'plot(1:10, main = "ten")\nwriteLines("hello file", "out.txt")\ndata.frame(x = 1:3, y = c("a", "b", "c"))');
  await page.locator("#run").click();
  const top = page.locator("#history .entry").first();
  await expect(top.locator("img.plot")).toBeVisible();
  const table = top.locator("table.df");
  await expect(table).toBeVisible();
  await expect(table.locator("caption")).toContainText("3 × 2");
  await expect(table.locator("tbody tr")).toHaveCount(3);
  await expect(table.locator("tbody tr").nth(2)).toContainText("c");
  // The table's printed text is not shown again above it.
  for (const pre of await top.locator("pre.stdout").allTextContents()) {
    expect(pre).not.toContain("1 1 a");
  }
  const png = await top.locator("img.plot").evaluate((img) => img.naturalWidth);
  expect(png).toBeGreaterThan(100);
  // The file the call wrote, from the entry's link and the files list.
  const link = top.locator('a.file[data-file="out.txt"]');
  await expect(link).toBeVisible();
  const [download] = await Promise.all([page.waitForEvent("download"), link.click()]);
  const saved = await download.path();
  expect(fs.readFileSync(saved, "utf8")).toBe("hello file\n");
  expect(download.suggestedFilename()).toBe("out.txt");
  await expect(page.locator('#files a.file[data-file="out.txt"]')).toBeVisible();
  await expect(page.locator("#status")).toContainText("idle");
  await expect(page.locator("#cancel")).toBeDisabled();
  await shot(page, "session");
});

test("a script in an HTML display runs sandboxed and cannot read the console's token or DOM", async ({ page }) => {
  const { tokens } = state();
  await signIn(page, tokens.alice);
  await page.goto(`${state().base}/ui/#/session/${sessionId}`);
  const probe = [
    '<div id="out">pending</div><script>',
    "var r = [];",
    'try { r.push("storage:" + window.sessionStorage.getItem("rvisor-token")); } catch (e) { r.push("storage:blocked"); }',
    'try { r.push("parent:" + window.parent.document.body.innerHTML.length); } catch (e) { r.push("parent:blocked"); }',
    'try { r.push("top:" + window.top.sessionStorage.getItem("rvisor-token")); } catch (e) { r.push("top:blocked"); }',
    'try { r.push("cookie:" + document.cookie); } catch (e) { r.push("cookie:blocked"); }',
    'document.getElementById("out").textContent = r.join(" ");',
    "</script>",
  ].join("\n");
  await page.locator("#code").fill(`htmltools::HTML('${probe}')`);
  await page.locator("#run").click();
  const frameEl = page.locator("#history .entry").first().locator("iframe.html-display");
  await expect(frameEl).toBeVisible();
  expect(await frameEl.getAttribute("sandbox")).toBe("allow-scripts");
  const out = page.frameLocator("#history .entry >> nth=0 >> iframe.html-display").locator("#out");
  // The script ran (it wrote its findings), and every read was refused.
  await expect(out).toHaveText("storage:blocked parent:blocked top:blocked cookie:blocked");
  const text = await out.textContent();
  expect(text).not.toContain(tokens.alice);
  await shot(page, "session-html-display");
});

test("a second tenant's token sees none of it", async ({ page }) => {
  const { tokens, base } = state();
  await signIn(page, tokens.bob);
  await expect(page.locator("#sessions")).toContainText("No sessions yet.");
  await page.goto(`${base}/ui/#/session/${sessionId}`);
  await expect(page.locator(".error")).toContainText("no such session");
  await expect(page.locator("#history .entry")).toHaveCount(0);
  // The API answers the same: their session is like an unknown one.
  const theirs = await api("GET", `/v1/sessions/${sessionId}/history`, tokens.bob);
  const unknown = await api("GET", "/v1/sessions/s-00000000000000000000000000000000/history", tokens.bob);
  expect(theirs.status).toBe(404);
  expect(theirs.body).toEqual(unknown.body);
  // The operator page is not theirs either.
  await page.goto(`${base}/ui/#/admin`);
  await expect(page.locator(".error")).toContainText("for operators");
  await expect(page.locator("#nav-admin")).toBeHidden();
});

test("the operator page shows the node, admission and charts of the last hour", async ({ page }) => {
  const { tokens, base } = state();
  await signIn(page, tokens.ops);
  await expect(page.locator("#nav-admin")).toBeVisible();
  await page.locator("#nav-admin").click();
  await expect(page.locator("#nodes tbody tr")).toHaveCount(1);
  await expect(page.locator("#admission")).toContainText("live sessions");
  await expect(page.locator("#charts svg.chart")).toHaveCount(2);
  await expect(page.locator("#charts svg.chart").first().locator("rect.bar")).toHaveCount(60);
  await expect(page.locator("h2", { hasText: "Calls in the last hour" })).not.toContainText(": 0");
  // The operator's own session list has none of alice's.
  await page.goto(`${base}/ui/#/sessions`);
  await expect(page.locator("#sessions")).toContainText("No sessions yet.");
  await page.goto(`${base}/ui/#/admin`);
  await expect(page.locator("#charts svg.chart")).toHaveCount(2);
  await shot(page, "admin");
});

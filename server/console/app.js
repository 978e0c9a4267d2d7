// The rvisor web console (docs/console.md): plain JavaScript, no build
// step, no dependencies. It uses the same HTTP API as every client, with
// the tenant token the person signs in with, kept in sessionStorage (this
// tab only) and sent as an `Authorization: Bearer` header: never in a
// URL, never in a cookie (so no request can be forged cross-site). Text
// from R is put into the page as text (textContent), never as HTML; HTML
// displays go to sandboxed iframes (/ui/frame.html).
"use strict";

(function () {
  const TOKEN_KEY = "rvisor-token";
  const main = () => document.getElementById("main");
  let stopPage = () => {};
  // Why the sign-in page is shown again (a token that stopped working).
  let signInWhy = "";

  // ---- helpers ----------------------------------------------------------

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : v);
    }
    for (const k of kids) if (k !== null && k !== undefined) e.append(k);
    return e;
  }

  function svg(tag, attrs) {
    const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    return e;
  }

  const token = () => sessionStorage.getItem(TOKEN_KEY);

  class ApiError extends Error {
    constructor(status, body) {
      super((body && body.error && body.error.message) || `HTTP ${status}`);
      this.status = status;
    }
  }

  async function api(path, opts = {}) {
    const headers = Object.assign({}, opts.headers || {});
    const t = token();
    if (t) headers.Authorization = `Bearer ${t}`;
    if (opts.json !== undefined) {
      headers["Content-Type"] = "application/json";
      opts.body = JSON.stringify(opts.json);
    }
    const r = await fetch(path, { method: opts.method || "GET", headers, body: opts.body, cache: "no-store", signal: opts.signal });
    if (opts.raw) {
      if (!r.ok) throw new ApiError(r.status, await r.json().catch(() => null));
      return r;
    }
    const body = r.status === 204 ? null : await r.json().catch(() => null);
    if (r.status === 401 && !opts.signingIn) {
      signOut("Your token was not accepted: sign in again.");
      throw new ApiError(401, body);
    }
    if (!r.ok) throw new ApiError(r.status, body);
    return body;
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const u = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
  }

  function fmtSecs(s) {
    if (s === null || s === undefined) return "–";
    if (s < 60) return `${s.toFixed(0)} s`;
    if (s < 3600) return `${(s / 60).toFixed(0)} min`;
    return `${(s / 3600).toFixed(1)} h`;
  }

  function show(...nodes) {
    const m = main();
    m.replaceChildren(...nodes);
  }

  function problem(e) {
    return el("p", { class: "error", role: "alert", text: e.message || String(e) });
  }

  // ---- sign in ----------------------------------------------------------

  function signOut(why) {
    sessionStorage.removeItem(TOKEN_KEY);
    signInWhy = why || "";
    if (location.hash !== "#/signin") location.hash = "#/signin"; // routes again
    else route();
  }

  function renderSignIn(why) {
    document.getElementById("nav").hidden = true;
    const input = el("input", { type: "password", id: "token", autocomplete: "off", placeholder: "token", "aria-label": "token" });
    const msg = el("p", { class: "error", id: "signin-error", text: why || "" });
    const form = el("form", {
      class: "card signin",
      onsubmit: async (ev) => {
        ev.preventDefault();
        const t = input.value.trim();
        if (!t) return;
        sessionStorage.setItem(TOKEN_KEY, t);
        try {
          await api("/v1/usage", { signingIn: true });
        } catch (e) {
          sessionStorage.removeItem(TOKEN_KEY);
          msg.textContent = e.status === 401 ? "That token is not valid here." : e.message;
          return;
        }
        if (location.hash === "#/sessions") route();
        else location.hash = "#/sessions";
      },
    },
    el("h1", { text: "Sign in" }),
    el("p", { class: "muted", text: "Paste your rvisor token. It stays in this browser tab only." }),
    input, msg,
    el("button", { type: "submit", class: "primary", id: "sign-in", text: "Sign in" }));
    show(form);
    input.focus();
  }

  // ---- session list -----------------------------------------------------

  async function renderSessions() {
    const list = el("tbody");
    const table = el("table", { class: "list", id: "sessions" },
      el("thead", {}, el("tr", {}, ...["Session", "State", "Idle", "Memory", "Last call"].map((h) => el("th", { text: h })))),
      list);
    const err = el("div");
    const create = el("button", {
      type: "button", id: "new-session",
      onclick: async () => {
        try {
          const s = await api("/v1/sessions", { method: "POST" });
          location.hash = `#/session/${encodeURIComponent(s.id)}`;
        } catch (e) { err.replaceChildren(problem(e)); }
      },
    }, "New session");
    show(el("h1", { text: "Sessions" }), err, table, el("p", {}, create));
    const load = async () => {
      let body;
      try { body = await api("/v1/sessions"); } catch (e) { err.replaceChildren(problem(e)); return; }
      const rows = body.sessions.map((s) => el("tr", { "data-session": s.id },
        el("td", {}, el("a", { href: `#/session/${encodeURIComponent(s.id)}`, text: s.name ? `${s.name} (${s.id})` : s.id })),
        el("td", {}, el("span", { class: `state ${s.state}`, text: s.state })),
        el("td", { text: fmtSecs(s.idle_seconds) }),
        el("td", { text: fmtBytes(s.memory_bytes) }),
        el("td", {}, s.last_call
          ? el("code", { text: `${s.last_call.code.split("\n")[0]}  → ${s.last_call.outcome}` })
          : el("span", { class: "muted", text: "none yet" }))));
      if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "5", class: "muted", text: "No sessions yet." })));
      list.replaceChildren(...rows);
    };
    await load();
    const timer = setInterval(load, 3000);
    stopPage = () => clearInterval(timer);
  }

  // ---- one session ------------------------------------------------------

  // An HTML display in a sandboxed frame: an opaque origin (no
  // allow-same-origin) that can reach neither this page nor its storage.
  function htmlFrame(html) {
    const f = el("iframe", { class: "html-display", sandbox: "allow-scripts", src: "/ui/frame.html", title: "HTML display", referrerpolicy: "no-referrer" });
    let sent = false;
    f.addEventListener("load", () => {
      if (sent) return;
      sent = true;
      f.contentWindow.postMessage(html, "*");
    });
    return f;
  }

  function cellText(v) {
    if (v === null || v === undefined) return "NA";
    return typeof v === "object" ? JSON.stringify(v) : String(v);
  }

  // A table display from its typed JSON preview, built as DOM text.
  function tableDisplay(d) {
    const j = d.data["application/json"];
    if (!j || !Array.isArray(j.columns)) return el("pre", { text: d.data["text/plain"] || "" });
    const cls = (d.metadata && d.metadata.rvisor && d.metadata.rvisor.class) || "table";
    const shown = (j.rows || []).length;
    const caption = `A ${cls}: ${j.nrow} × ${j.ncol}` + (j.truncated ? ` (${shown} rows shown)` : "");
    const numeric = j.columns.map((c) => ["integer", "numeric", "double"].includes(c.type));
    const head = el("tr", {}, ...(j.row_names ? [el("th", { text: "" })] : []),
      ...j.columns.map((c) => el("th", {}, c.name, el("br"), el("span", { class: "muted", text: `<${c.type}>` }))));
    const rows = (j.rows || []).map((r, i) => el("tr", {},
      ...(j.row_names ? [el("th", { text: cellText(j.row_names[i]) })] : []),
      ...r.map((v, k) => el("td", { class: numeric[k] ? "num" : null, text: cellText(v) }))));
    return el("div", { class: "scroll" }, el("table", { class: "df" }, el("caption", { text: caption }), el("thead", {}, head), el("tbody", {}, ...rows)));
  }

  function displayNode(d) {
    const kind = d.metadata && d.metadata.rvisor && d.metadata.rvisor.kind;
    if (kind === "plot") return null; // its plot segment shows it
    if (kind === "table" || (d.data["application/json"] && d.data["application/json"].columns)) return tableDisplay(d);
    if (typeof d.data["text/html"] === "string") return htmlFrame(d.data["text/html"]);
    if (typeof d.data["image/png"] === "string") return el("img", { class: "plot", alt: "image", src: `data:image/png;base64,${d.data["image/png"]}` });
    if (typeof d.data["text/plain"] === "string") return el("pre", { text: d.data["text/plain"] });
    return null;
  }

  // The output of one call in the order it happened. A table display's
  // printed text (`text/plain`, which R also wrote to the console just
  // before it) is not shown again above the table.
  function outputNodes(entry) {
    const out = [];
    const segs = entry.segments || [];
    if (!segs.length) {
      if (entry.console) out.push(el("pre", { class: "stdout", text: entry.console }));
      for (const p of entry.plots || []) out.push(plotImg(p));
      return out;
    }
    let text = "", textKind = null;
    const flush = () => {
      if (text) out.push(el("pre", { class: textKind, text }));
      text = ""; textKind = null;
    };
    const add = (kind, t) => {
      if (textKind !== kind) flush();
      textKind = kind; text += t;
    };
    for (const s of segs) {
      switch (s.kind) {
        case "stdout": case "stderr": case "message": add(s.kind, s.text || ""); break;
        case "warning": add("warning", `Warning${s.call ? ` in ${s.call}` : ""}: ${s.message}\n`); break;
        case "error": add("error", `Error${s.call ? ` in ${s.call}` : ""}: ${s.message}\n`); break;
        case "plot": {
          flush();
          const p = (entry.plots || [])[s.index];
          if (p) out.push(plotImg(p));
          break;
        }
        case "display": {
          const d = (entry.displays || [])[s.index];
          if (!d) break;
          const printed = typeof d.data["text/plain"] === "string" ? d.data["text/plain"].replace(/\n+$/, "") : null;
          const kind = d.metadata && d.metadata.rvisor && d.metadata.rvisor.kind;
          if (kind === "table" && printed && textKind === "stdout") {
            const t = text.replace(/\n+$/, "");
            if (t.endsWith(printed)) text = t.slice(0, t.length - printed.length);
            if (!text.trim()) text = "";
          }
          flush();
          const n = displayNode(d);
          if (n) out.push(n);
          break;
        }
        default: break;
      }
    }
    flush();
    return out;
  }

  function plotImg(p) {
    const mime = p.mime || "image/png";
    if (mime === "image/svg+xml") return el("img", { class: "plot", alt: "plot", src: `data:image/svg+xml;charset=utf-8,${encodeURIComponent(p.data_base64 || "")}` });
    return el("img", { class: "plot", alt: "plot", src: `data:${mime};base64,${p.data_base64}` });
  }

  async function download(sessionId, name) {
    const path = name.split("/").map(encodeURIComponent).join("/");
    const r = await api(`/v1/sessions/${encodeURIComponent(sessionId)}/files/${path}`, { raw: true });
    const blob = await r.blob();
    const url = URL.createObjectURL(blob);
    const a = el("a", { href: url, download: name.split("/").pop() });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  }

  function fileLink(sessionId, name, size) {
    return el("a", {
      href: "#", class: "file", "data-file": name,
      onclick: (ev) => { ev.preventDefault(); download(sessionId, name).catch((e) => alert(e.message)); },
    }, `${name}${size !== undefined ? ` (${fmtBytes(size)})` : ""}`);
  }

  function entryNode(sessionId, e) {
    if (e.kind !== "call") {
      return el("div", { class: "card entry event", "data-seq": e.seq },
        el("div", { class: "entry-head" }, el("strong", { text: e.kind === "reset" ? "Session reset" : "Session restored" }),
          el("span", { class: "muted", text: `${e.reason || ""} · ${e.ended_at}` })));
    }
    const bad = !e.success;
    const files = (e.files || []).map((f) => fileLink(sessionId, f.name, f.size));
    return el("div", { class: "card entry", "data-seq": e.seq, "data-execution": e.execution_id || "" },
      el("div", { class: "entry-head" },
        el("span", { class: `outcome${bad ? " bad" : ""}`, text: e.outcome }),
        el("span", { class: "muted", text: `${e.started_at} · ${e.duration_ms.toFixed(0)} ms` })),
      el("pre", { class: "code", text: e.code }),
      ...outputNodes(e),
      files.length ? el("div", { class: "files" }, "Files: ", ...files) : null,
      e.truncated ? el("p", { class: "muted", text: e.truncated }) : null);
  }

  // Reads an SSE body: calls `on(event, data)` for each event.
  async function readSse(res, on) {
    const reader = res.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, i);
        buf = buf.slice(i + 2);
        let ev = "message", data = "";
        for (const line of block.split("\n")) {
          if (line.startsWith("event: ")) ev = line.slice(7);
          else if (line.startsWith("data: ")) data += line.slice(6);
        }
        if (data) on(ev, JSON.parse(data));
      }
    }
  }

  async function renderSession(id) {
    const sid = encodeURIComponent(id);
    const status = el("div", { class: "muted", id: "status" });
    const live = el("pre", { id: "live", class: "stdout", hidden: true });
    const liveLabel = el("h2", { text: "Running now", hidden: true, id: "live-label" });
    const history = el("div", { id: "history" });
    const files = el("div", { class: "files", id: "files" });
    const err = el("div");
    const code = el("textarea", { id: "code", placeholder: "R code to run in this session", spellcheck: "false" });
    const runBtn = el("button", { type: "button", class: "primary", id: "run", text: "Run" });
    const cancelBtn = el("button", { type: "button", class: "danger", id: "cancel", text: "Cancel", disabled: true });
    const more = el("button", { type: "button", id: "older", text: "Older entries", hidden: true });
    let next = null, newest = 0, ownCall = false, gone = false, wasRunning = false, polls = 0;
    // The call the watch stream is showing (another client's, in full).
    let watched = null;

    show(el("h1", {}, "Session ", el("code", { text: id })), status, err,
      el("div", { class: "card run-box" }, code, el("div", { class: "buttons" }, runBtn, cancelBtn)),
      liveLabel, live,
      el("h2", { text: "Files" }), files,
      el("h2", { text: "History" }), history, more);

    const loadHistory = async (reset) => {
      const q = reset || next === null ? "" : `&before=${encodeURIComponent(next)}`;
      const page = await api(`/v1/sessions/${sid}/history?limit=20${q}`);
      const nodes = page.entries.map((e) => entryNode(id, e));
      if (reset) {
        history.replaceChildren(...nodes);
        newest = page.entries.length ? page.entries[0].seq : 0;
      } else history.append(...nodes);
      next = page.next;
      more.hidden = next === null;
      if (!page.entries.length && reset) history.replaceChildren(el("p", { class: "muted", text: "Nothing has run in this session yet." }));
    };
    const loadFiles = async () => {
      const body = await api(`/v1/sessions/${sid}/files`);
      files.replaceChildren(...(body.files.length ? body.files.map((f) => fileLink(id, f.name, f.size)) : [el("span", { class: "muted", text: "No files." })]));
    };
    more.addEventListener("click", () => loadHistory(false).catch((e) => err.replaceChildren(problem(e))));

    const poll = async () => {
      let st;
      try { st = await api(`/v1/sessions/${sid}`); } catch (e) {
        if (e.status === 404) { gone = true; err.replaceChildren(problem(new Error("There is no such session (it was closed, or is not yours)."))); }
        return;
      }
      status.replaceChildren(el("span", { class: `state ${st.state}`, text: st.state }),
        ` generation ${st.generation}` + (st.queued ? ` · ${st.queued} queued` : ""));
      cancelBtn.disabled = !st.running && !ownCall;
      if (st.running && !ownCall && watched === st.running.execution_id) {
        // Shown in full by the watch stream.
      } else if (st.running && !ownCall) {
        // A call that started before the watch: its last lines, as
        // status reports them.
        liveLabel.hidden = false; live.hidden = false;
        live.textContent = st.running.output_tail || "";
        live.dataset.execution = st.running.execution_id;
      } else if (!ownCall) {
        liveLabel.hidden = true; live.hidden = true;
      }
      // A call that ended since the last look (seen ending, or one too
      // short to be seen running: checked every 2 s): read the history.
      const ended = wasRunning && !st.running;
      wasRunning = !!st.running;
      if (!ended && ++polls % 5 !== 0) return;
      const top = await api(`/v1/sessions/${sid}/history?limit=1`).catch(() => null);
      if (top && top.entries.length && top.entries[0].seq !== newest) {
        await loadHistory(true).catch(() => {});
        loadFiles().catch(() => {});
      }
    };

    let busy = false;
    const refresh = async () => {
      if (busy || gone) return;
      busy = true;
      try { await poll(); } finally { busy = false; }
    };

    runBtn.addEventListener("click", async () => {
      const src = code.value;
      if (!src.trim()) return;
      ownCall = true; runBtn.disabled = true; cancelBtn.disabled = false;
      liveLabel.hidden = false; live.hidden = false; live.textContent = "";
      err.replaceChildren();
      try {
        const res = await api(`/v1/sessions/${sid}/run`, { method: "POST", json: { code: src }, headers: { Accept: "text/event-stream" }, raw: true });
        await readSse(res, (ev, data) => {
          if (["stdout", "stderr", "message"].includes(ev)) live.textContent += data.text || "";
          else if (ev === "warning") live.textContent += `Warning: ${data.message}\n`;
          else if (ev === "error") live.textContent += `Error: ${data.message}\n`;
        });
      } catch (e) {
        err.replaceChildren(problem(e));
      } finally {
        ownCall = false; runBtn.disabled = false;
        liveLabel.hidden = true; live.hidden = true;
        await loadHistory(true).catch(() => {});
        loadFiles().catch(() => {});
        refresh();
      }
    });
    cancelBtn.addEventListener("click", async () => {
      try { await api(`/v1/sessions/${sid}/cancel`, { method: "POST" }); } catch (e) { err.replaceChildren(problem(e)); }
    });

    try {
      await loadHistory(true);
      await loadFiles();
    } catch (e) {
      if (e.status === 404) { err.replaceChildren(problem(new Error("There is no such session (it was closed, or is not yours)."))); return; }
      err.replaceChildren(problem(e));
    }
    // Every call that starts from now on, whoever runs it, in full: the
    // session's watch stream (reconnected if it drops).
    const stopWatch = new AbortController();
    const watch = async () => {
      while (!stopWatch.signal.aborted && !gone) {
        try {
          const res = await api(`/v1/sessions/${sid}/watch`, { headers: { Accept: "text/event-stream" }, raw: true, signal: stopWatch.signal });
          await readSse(res, (ev, data) => {
            if (ev === "watching") { live.dataset.watching = "1"; return; }
            if (ownCall) return;
            if (ev === "call") {
              watched = data.execution_id;
              liveLabel.hidden = false; live.hidden = false;
              live.textContent = ""; live.dataset.execution = watched;
              cancelBtn.disabled = false;
            } else if (data.execution_id !== watched) {
              return;
            } else if (["stdout", "stderr", "message"].includes(ev)) {
              live.textContent += data.text || "";
            } else if (ev === "warning") {
              live.textContent += `Warning: ${data.message}\n`;
            } else if (ev === "error") {
              live.textContent += `Error: ${data.message}\n`;
            } else if (ev === "result") {
              watched = null;
              liveLabel.hidden = true; live.hidden = true;
              loadHistory(true).catch(() => {});
              loadFiles().catch(() => {});
            }
          });
        } catch (e) {
          if (stopWatch.signal.aborted || (e && e.status === 404)) return;
        }
        delete live.dataset.watching;
        await new Promise((r) => setTimeout(r, 1000));
      }
    };
    watch();
    const timer = setInterval(refresh, 400);
    refresh();
    stopPage = () => { clearInterval(timer); stopWatch.abort(); };
  }

  // ---- operator ---------------------------------------------------------

  function chart(title, minutes, value, kind, unit) {
    const W = 720, H = 160, P = 30;
    const vals = minutes.map(value);
    const max = Math.max(1, ...vals);
    const s = svg("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "aria-label": title });
    const x = (i) => P + (i * (W - 2 * P)) / Math.max(1, vals.length - 1);
    const y = (v) => H - P - (v / max) * (H - 2 * P);
    const label = svg("text", { x: P, y: 14 });
    label.textContent = `${title} (max ${max.toFixed(kind === "bar" ? 0 : 1)}${unit})`;
    s.append(label);
    if (kind === "bar") {
      const w = (W - 2 * P) / vals.length;
      vals.forEach((v, i) => s.append(svg("rect", { class: "bar", x: P + i * w, y: y(v), width: Math.max(1, w - 1), height: H - P - y(v) })));
    } else {
      s.append(svg("polyline", { class: "line", points: vals.map((v, i) => `${x(i)},${y(v)}`).join(" ") }));
    }
    const axis = svg("text", { x: P, y: H - 8 });
    axis.textContent = "60 min ago";
    const now = svg("text", { x: W - P - 24, y: H - 8 });
    now.textContent = "now";
    s.append(axis, now, svg("line", { x1: P, y1: H - P, x2: W - P, y2: H - P, stroke: "#d9dde5" }));
    return s;
  }

  async function renderAdmin() {
    const err = el("div");
    const body = el("div", { id: "admin" });
    show(el("h1", { text: "Operator" }), err, body);
    const load = async () => {
      let st;
      try { st = await api("/v1/admin/stats"); } catch (e) {
        err.replaceChildren(problem(e.status === 403 ? new Error("This page is for operators: sign in with an operator's token.") : e));
        return;
      }
      const nodes = el("table", { class: "list", id: "nodes" },
        el("thead", {}, el("tr", {}, ...["Node", "Sessions", "Draining", "Version", "R", "Up"].map((h) => el("th", { text: h })))),
        el("tbody", {}, ...st.nodes.map((n) => el("tr", {},
          el("td", { text: n.node_id || "(single node)" }), el("td", { text: String(n.sessions) }),
          el("td", { text: n.draining ? "yes" : "no" }), el("td", { text: n.version }),
          el("td", { text: n.r_version }), el("td", { text: fmtSecs(n.uptime_seconds) })))));
      const a = st.admission;
      const kv = el("div", { class: "kv", id: "admission" });
      for (const [k, v] of [
        ["live sessions", `${a.live_sessions}${a.max_live_sessions ? ` of ${a.max_live_sessions}` : ""}`],
        ["hibernated sessions", a.hibernated_sessions],
        ["calls in flight", a.calls_in_flight],
        ["workers' memory", fmtBytes(a.worker_memory_bytes)],
        ["memory budget", a.memory_budget_bytes ? fmtBytes(a.memory_budget_bytes) : "none"],
        ["sessions (all tenants)", `${st.sessions} of ${a.max_sessions}`],
      ]) kv.append(el("span", { class: "muted", text: k }), el("span", { text: String(v) }));
      const calls = st.minutes.reduce((n, m) => n + m.calls, 0);
      body.replaceChildren(
        el("h2", { text: "Nodes" }), nodes,
        el("h2", { text: "Admission" }), el("div", { class: "card" }, kv),
        el("h2", { text: `Calls in the last hour: ${calls}` }),
        el("div", { class: "scroll", id: "charts" },
          chart("Calls per minute", st.minutes, (m) => m.calls, "bar", ""),
          el("br"),
          chart("Mean latency per minute", st.minutes, (m) => m.mean_ms, "line", " ms")));
    };
    await load();
    const timer = setInterval(load, 5000);
    stopPage = () => clearInterval(timer);
  }

  // ---- routing ----------------------------------------------------------

  async function route() {
    stopPage();
    stopPage = () => {};
    if (!token()) {
      const why = signInWhy;
      signInWhy = "";
      return renderSignIn(why);
    }
    document.getElementById("nav").hidden = false;
    // The operator link only for tokens that may read the stats.
    api("/v1/admin/stats").then(() => { document.getElementById("nav-admin").hidden = false; }, () => {});
    const h = location.hash || "#/sessions";
    const m = h.match(/^#\/session\/(.+)$/);
    if (m) return renderSession(decodeURIComponent(m[1]));
    if (h === "#/admin") return renderAdmin();
    return renderSessions();
  }

  window.addEventListener("hashchange", route);
  document.addEventListener("DOMContentLoaded", () => {
    document.getElementById("sign-out").addEventListener("click", () => signOut());
    route();
  });
})();

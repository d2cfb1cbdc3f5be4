// rlhfkit label: the page. Plain JS, no build step. Model output is only ever set as text (textContent), never as
// HTML, so a response holding <script> or markup shows literally.
"use strict";

const $ = (id) => document.getElementById(id);
let annotator = null;   // who is labelling (the URL's ?annotator=, else remembered in this browser)
let current = null;     // the item on screen: {item, token, ...}
let harmful = new Set(); // the sides flagged harmful for the item on screen ("a", "b")
let busy = false;       // a request is in flight: keys wait, so nothing is sent twice
// A per-person link's token (?token=): sent with every request, so two people's links in one browser stay apart.
const linkToken = new URLSearchParams(location.search).get("token");

function setStatus(text, isError) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

// A response or prompt: text, or chat messages (tool calls and tool results included), each built from text nodes.
function render(container, content) {
  container.replaceChildren();
  if (typeof content === "string") {
    const div = document.createElement("div");
    div.className = "text";
    div.textContent = content;
    container.append(div);
    return;
  }
  for (const m of content) {
    const div = document.createElement("div");
    div.className = "msg " + String(m.role);
    const role = document.createElement("div");
    role.className = "role";
    role.textContent = m.role + (m.name ? " · " + m.name : "") + (m.tool_call_id ? " · " + m.tool_call_id : "");
    div.append(role);
    if (m.content) {
      const body = document.createElement("div");
      body.className = "content";
      body.textContent = m.content;
      div.append(body);
    }
    for (const call of m.tool_calls || []) {
      const fn = call.function || call;
      let args = fn.arguments;
      if (typeof args !== "string") args = JSON.stringify(args);
      const pre = document.createElement("div");
      pre.className = "call";
      pre.textContent = "→ " + fn.name + "(" + (args || "") + ")";
      div.append(pre);
    }
    container.append(div);
  }
}

function showProgress(p) {
  $("progress").textContent = "done " + p.done + " / " + p.total;
  $("who").textContent = annotator + ": " + (p.mine || 0) + " judged";
  const all = Object.entries(p.annotators).map(([n, c]) => n + " " + c).join(", ");
  $("annotators").textContent = all ? "everyone: " + all : "";
}

function showFlags() {
  for (const side of ["a", "b"]) {
    $("flag-" + side).hidden = !harmful.has(side);
    $("side-" + side).classList.toggle("harmful", harmful.has(side));
  }
}

function show(data) {
  showProgress(data.progress);
  harmful = new Set();
  showFlags();
  if (data.done) {
    current = null;
    $("work").hidden = true;
    $("finished").hidden = false;
    return;
  }
  current = data;
  $("finished").hidden = true;
  $("work").hidden = false;
  $("work").dataset.item = String(data.item);
  render($("prompt"), data.prompt);
  render($("left"), data.a);
  render($("right"), data.b);
}

// The server takes writes only as JSON (Content-Type: application/json) from its own page: keep both.
async function call(method, path, body) {
  const headers = body ? {"Content-Type": "application/json"} : {};
  if (linkToken) headers["X-Label-Token"] = linkToken;
  const response = await fetch(path, {
    method, headers, body: body ? JSON.stringify(body) : undefined, credentials: "same-origin",
  });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || ("HTTP " + response.status));
  return data;
}

async function guarded(action) {
  if (busy) return;
  busy = true;
  try { await action(); } catch (e) { setStatus(e.message, true); } finally { busy = false; }
}

function load() {
  return guarded(async () => {
    show(await call("GET", "api/item?annotator=" + encodeURIComponent(annotator)));
    setStatus("", false);
  });
}

function choose(choice) {
  if (!current) return;
  return guarded(async () => {
    const item = current.item;
    const data = await call("POST", "api/judge", {
      annotator, item, token: current.token, choice, harmful: [...harmful],
    });
    setStatus("saved item " + item + " (" + choice.replace("_", " ") + ")", false);
    show(data.next);
  });
}

function undo() {
  return guarded(async () => {
    const data = await call("POST", "api/undo", {annotator});
    setStatus("undone: back to item " + (data.next.item ?? "-"), false);
    show(data.next);
  });
}

function flag(side) {
  if (!current) return;
  if (harmful.has(side)) harmful.delete(side); else harmful.add(side);
  showFlags();
}

const KEYS = {"1": () => choose("a"), "2": () => choose("b"), "3": () => choose("tie"), "4": () => choose("both_bad"),
              "s": () => choose("skip"), "u": undo, "h": () => flag("a"), "j": () => flag("b")};

document.addEventListener("keydown", (e) => {
  if (!annotator || e.altKey || e.metaKey || e.target.tagName === "INPUT") return;
  if (e.ctrlKey && e.key === "z") { e.preventDefault(); undo(); return; }
  if (e.ctrlKey) return;
  const action = KEYS[e.key.toLowerCase()];
  if (action) { e.preventDefault(); action(); }
});

function start(name, remember) {
  annotator = name;
  if (remember) localStorage.setItem("rlhfkit-label-annotator", name);
  $("signin").hidden = true;
  load();
}

document.addEventListener("DOMContentLoaded", async () => {
  for (const b of document.querySelectorAll("[data-choice]")) b.addEventListener("click", () => choose(b.dataset.choice));
  for (const b of document.querySelectorAll("[data-flag]")) b.addEventListener("click", () => flag(b.dataset.flag));
  $("undo").addEventListener("click", undo);
  $("signin").addEventListener("submit", (e) => { e.preventDefault(); start($("name").value.trim(), true); });
  // A per-person link names its person: the page acts as them and asks no name.
  let me = null;
  try { me = (await call("GET", "api/me")).annotator; } catch (e) { setStatus(e.message, true); return; }
  if (me) { start(me, false); return; }
  const name = new URLSearchParams(location.search).get("annotator") || localStorage.getItem("rlhfkit-label-annotator");
  if (name) start(name, true); else { $("signin").hidden = false; $("name").focus(); }
});

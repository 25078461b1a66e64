/* dagfold dashboard: plain JavaScript, canvas for the DAG and the timeline, no build step, no CDN.
 *
 * Pages (hash routes): #/jobs, #/jobs/<id>, #/ops, #/cluster, #/deadletters (static/deadletters.js). Data comes from the REST API under /v1;
 * a job page follows GET /v1/jobs/<id>/events (server-sent events, read with fetch so the API key can
 * travel in a header) and recolours graph nodes from each history entry's task_state.
 * window.__dagfold exposes a few read-only hooks for the end-to-end browser test.
 */
"use strict";

const STATE_COLORS = {
  pending: "#c8ccd2", runnable: "#e9b949", running: "#3b82f6", retrying: "#f08c2e",
  succeeded: "#2e9e5b", failed: "#d64545", skipped: "#9aa3ad", cancelled: "#6b7280",
};
const TASK_STATES = Object.keys(STATE_COLORS);
const MARK_COLOR = "#dc2626";  // a rejected job's offending edges and tasks
const OUTCOME_COLORS = { running: "#3b82f6", succeeded: "#2e9e5b", failed: "#d64545", cancelled: "#6b7280" };
const TERMINAL = new Set(["succeeded", "succeeded_partial", "failed", "cancelled", "rejected"]);
const JOB_STATES = ["running", "paused", "succeeded", "succeeded_partial", "failed", "cancelled", "rejected"];

const $ = (sel, root = document) => root.querySelector(sel);
const view = $("#view");
const tooltip = $("#tooltip");
const hooks = (window.__dagfold = { page: null, graph: null, ready: false });

// -- helpers -------------------------------------------------------------------------------
function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}
const enc = encodeURIComponent;
function fmtTime(ms) {
  if (ms == null) return "";
  const d = new Date(ms);
  return d.toLocaleDateString(undefined, { month: "short", day: "numeric" }) + " " + d.toTimeString().slice(0, 8);
}
function fmtDur(ms) {
  if (ms == null) return "";
  if (ms < 1000) return `${ms} ms`;
  const s = ms / 1000;
  if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} m ${Math.round(s % 60)} s`;
  return `${Math.floor(m / 60)} h ${m % 60} m`;
}
function exitNote(reason, code) {
  return code != null && !String(reason || "").includes(`exit code ${code}`) ? ` (exit code ${code})` : "";
}
/* A job state between running and ended (paused, or any added later) wears one look, .badge.holding: no CSS rule a state. */
const isHolding = (state) => JOB_STATES.includes(state) && state !== "running" && !TERMINAL.has(state);
function badge(state) { return `<span class="badge ${esc(state)}${isHolding(state) ? " holding" : ""}">${esc(state)}</span>`; }
function bar(pct) { return `<div class="bar" title="${(+pct || 0).toFixed(1)}%"><span style="width:${Math.min(100, +pct || 0)}%"></span></div>`; }
/* A job's tasks as one bar: finished states in their colours, in flight after them, pending left grey. */
function stackBar(job) {
  const total = job.total_tasks || 0;
  if (!total) return bar(0);
  const order = ["succeeded", "failed", "skipped", "cancelled", "running", "retrying", "runnable"];
  const parts = order.filter((s) => job.counts && job.counts[s]).map((s) =>
    `<span style="width:${(100 * job.counts[s]) / total}%;background:${STATE_COLORS[s]}" title="${s} ${job.counts[s]}"></span>`);
  return `<div class="bar stack">${parts.join("")}</div>`;
}
function hueColor(name) {
  let h = 0;
  for (const c of String(name)) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${h % 360}, 62%, 50%)`;
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// -- API access (API key in localStorage, sent as a bearer token) --------------------------
function apiKey() { return localStorage.getItem("dagfold.apiKey") || ""; }
/* `dagfold up --token` prints /ui/?token=...: keep the token as the key and take it out of the address bar. */
(function takeToken() {
  const params = new URLSearchParams(location.search);
  const t = params.get("token");
  if (!t) return;
  localStorage.setItem("dagfold.apiKey", t);
  params.delete("token");
  const q = params.toString();
  history.replaceState(null, "", location.pathname + (q ? `?${q}` : "") + location.hash);
})();
function authHeaders() { const k = apiKey(); return k ? { Authorization: `Bearer ${k}` } : {}; }
class ApiError extends Error {
  constructor(status, code, reason) { super(`${code}: ${reason}`); this.status = status; this.code = code; this.reason = reason; }
}
async function api(path, opts = {}) {
  const res = await fetch(path, { ...opts, headers: { ...authHeaders(), ...(opts.headers || {}) } });
  let body = null;
  try { body = await res.json(); } catch (e) { body = null; }
  if (!res.ok) {
    const e = (body && body.error) || { code: `http_${res.status}`, reason: res.statusText };
    if (res.status === 401) showKeyForm(true);
    throw new ApiError(res.status, e.code, e.reason);
  }
  return body;
}
function showKeyForm(show) { $("#keyform").hidden = !show; if (show) $("#apikey").focus(); }
$("#keybtn").addEventListener("click", () => showKeyForm($("#keyform").hidden));
$("#keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const v = $("#apikey").value.trim();
  if (v) localStorage.setItem("dagfold.apiKey", v); else localStorage.removeItem("dagfold.apiKey");
  $("#apikey").value = "";
  showKeyForm(false);
  route();
});
function errorBox(e) { return `<div class="error-box">${esc(e.message || e)}</div>`; }
function setLive(on) { $("#live").classList.toggle("on", !!on); }

/* Server-sent events over fetch (EventSource cannot send an Authorization header). Resumes after the
   last event id; stops on "end" or when the signal aborts. */
async function followJob(jobId, onEvent, signal) {
  let lastId = null;
  while (!signal.aborted) {
    try {
      const q = lastId ? `?after=${enc(lastId)}` : "";
      const res = await fetch(`/v1/jobs/${enc(jobId)}/events${q}`, { headers: authHeaders(), signal });
      if (!res.ok) throw new Error(`events: HTTP ${res.status}`);
      setLive(true);
      const reader = res.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let idx;
        while ((idx = buf.indexOf("\n\n")) >= 0) {
          const frame = buf.slice(0, idx);
          buf = buf.slice(idx + 2);
          let event = "message", data = "", id = null;
          for (const line of frame.split("\n")) {
            if (line.startsWith("event: ")) event = line.slice(7);
            else if (line.startsWith("data: ")) data += line.slice(6);
            else if (line.startsWith("id: ")) id = line.slice(4);
          }
          if (!data) continue;
          if (id) lastId = id;
          const payload = JSON.parse(data);
          onEvent(event, payload);
          if (event === "end") { setLive(false); return; }
        }
      }
    } catch (e) {
      if (signal.aborted) return;
    }
    setLive(false);
    await sleep(2000);
  }
}

// -- pan/zoom canvas base -----------------------------------------------------------------
class PanZoom {
  constructor(canvas, { zoomY = true } = {}) {
    this.canvas = canvas;
    this.ctx = canvas.getContext("2d");
    this.sx = 1; this.sy = 1; this.tx = 0; this.ty = 0;
    this.zoomY = zoomY;
    this.pending = false;
    this.drag = null;
    canvas.addEventListener("wheel", (e) => {
      e.preventDefault();
      const r = canvas.getBoundingClientRect();
      const mx = e.clientX - r.left, my = e.clientY - r.top;
      const f = Math.exp(-e.deltaY * 0.0015);
      let fx = f, fy = f;
      if (!this.zoomY) { if (e.shiftKey) fx = 1; else fy = 1; }
      this.touched = true;
      this.tx = mx - (mx - this.tx) * fx; this.sx *= fx;
      this.ty = my - (my - this.ty) * fy; this.sy *= fy;
      this.redraw();
    }, { passive: false });
    canvas.addEventListener("mousedown", (e) => { this.drag = { x: e.clientX, y: e.clientY, moved: false }; });
    window.addEventListener("mousemove", this._move = (e) => {
      if (!this.drag) return;
      const dx = e.clientX - this.drag.x, dy = e.clientY - this.drag.y;
      if (Math.abs(dx) + Math.abs(dy) > 2) this.drag.moved = this.touched = true;
      this.tx += dx; this.ty += dy; this.drag.x = e.clientX; this.drag.y = e.clientY;
      this.redraw();
    });
    window.addEventListener("mouseup", this._up = (e) => {
      const d = this.drag; this.drag = null;
      if (d && !d.moved && e.target === canvas) {
        const r = canvas.getBoundingClientRect();
        this.onClick(e.clientX - r.left, e.clientY - r.top);
      }
    });
    canvas.addEventListener("mousemove", (e) => {
      if (this.drag) return;
      const r = canvas.getBoundingClientRect();
      const text = this.hoverText(e.clientX - r.left, e.clientY - r.top);
      if (text) { tooltip.hidden = false; tooltip.textContent = text; tooltip.style.left = `${e.clientX + 12}px`; tooltip.style.top = `${e.clientY + 12}px`; }
      else tooltip.hidden = true;
    });
    canvas.addEventListener("mouseleave", () => { tooltip.hidden = true; });
    this.resize();
  }
  resize() {
    const dpr = window.devicePixelRatio || 1;
    const w = this.canvas.clientWidth, h = this.canvas.clientHeight;
    this.canvas.width = Math.max(1, Math.round(w * dpr)); this.canvas.height = Math.max(1, Math.round(h * dpr));
    this.dpr = dpr; this.w = w; this.h = h;
  }
  toWorld(x, y) { return [(x - this.tx) / this.sx, (y - this.ty) / this.sy]; }
  toScreen(x, y) { return [x * this.sx + this.tx, y * this.sy + this.ty]; }
  redraw() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => { this.pending = false; this.draw(); });
  }
  destroy() { window.removeEventListener("mousemove", this._move); window.removeEventListener("mouseup", this._up); }
  onClick() {}
  hoverText() { return null; }
  draw() {}
}

// -- the DAG -------------------------------------------------------------------------------
const NODE_W = 150, NODE_H = 22, GAP_X = 200, GAP_Y = 30, COL_W = NODE_W + 16;

// A task's group: its name's prefix (mProject_ID0000001 -> mProject, transform-3 -> transform).
const GROUP_RE = /^(.*?[A-Za-z])(?:[_\-.:#\/]|\d)/;
function taskGroup(id) { const m = GROUP_RE.exec(id); return m ? m[1] : id; }

/* The DAG on a canvas. `data` is the server's layout of every task (indexes into data.ids: "task
 * indexes"); what is drawn is a view of it ("node indexes"): a task per node, or, for a collapsed group,
 * one node standing for the group's tasks of a layer. Collapsing and expanding rebuilds the view in
 * O(tasks + edges); drawing stays O(nodes + edges drawn). */
class DagView extends PanZoom {
  constructor(canvas, data, onSelect) {
    super(canvas);
    this.onSelect = onSelect;
    this.selected = null;
    this.collapsed = new Set();  // group names drawn as one node a layer; kept across reloads
    this.load(data);
    this.fit();
  }
  load(data) {
    this.data = data;
    this._groups = null;
    this.group = data.ids.map(taskGroup);
    this.index = new Map(data.ids.map((id, i) => [id, i]));
    this.states = data.states.slice();
    this.markedRun = new Set(data.marked || []);  // succeeded by an operator's word, not run: a dashed outline
    // A rejected job's refused graph: the offending edges (parent * n + child) and tasks, drawn in red.
    const rj = (this.rejected = data.rejected || null), n = data.ids.length;
    this.markedEdges = new Set();
    this.markedTasks = new Set(rj ? rj.marked_tasks : []);
    if (rj) for (let k = 0; k + 1 < rj.marked_edges.length; k += 2) this.markedEdges.add(rj.marked_edges[k] * n + rj.marked_edges[k + 1]);
    this.build();
    if (this.onGroups) this.onGroups();
  }
  // The view: which node each task is drawn as, node positions, node edges (deduplicated).
  build() {
    const data = this.data, n = data.ids.length, sizes = this.layerGroups();
    const collapse = [...this.collapsed].some((g) => sizes.some((m) => (m.get(g) || 0) > 1));
    if (!collapse) {  // every task its own node: the server's layout as is
      this.node = Int32Array.from({ length: n }, (_, i) => i);
      this.vLayer = data.layer; this.vPos = data.pos; this.vLayers = data.layers; this.vEdges = data.edges;
      this.vTask = this.node; this.vMembers = new Array(n).fill(null);
    } else {
      const byLayer = data.layers.map((k) => new Array(k));
      for (let i = 0; i < n; i++) byLayer[data.layer[i]][data.pos[i]] = i;
      const node = new Int32Array(n), vLayer = [], vPos = [], vTask = [], vMembers = [], vLayers = [];
      byLayer.forEach((tasks, l) => {
        const open = new Map();  // group -> its node in this layer
        let k = 0;
        for (const i of tasks) {
          if (i === undefined) continue;
          const g = this.group[i];
          let v = open.get(g);
          if (v === undefined) {
            v = vLayer.length;
            vLayer.push(l); vPos.push(k++); vTask.push(i);
            const grouped = this.collapsed.has(g) && sizes[l].get(g) > 1;
            vMembers.push(grouped ? [] : null);
            if (grouped) open.set(g, v);
          }
          if (vMembers[v]) vMembers[v].push(i);
          node[i] = v;
        }
        vLayers.push(k);
      });
      const m = vLayer.length, seen = new Set(), vEdges = [], e = data.edges;
      for (let k = 0; k < e.length; k += 2) {
        const a = node[e[k]], b = node[e[k + 1]];
        if (a === b || seen.has(a * m + b)) continue;
        seen.add(a * m + b); vEdges.push(a, b);
      }
      Object.assign(this, { node, vLayer, vPos, vTask, vMembers, vLayers, vEdges });
    }
    const m = this.vLayer.length;
    this.vGrid = this.vLayers.map((k) => new Array(k));
    for (let v = 0; v < m; v++) this.vGrid[this.vLayer[v]][this.vPos[v]] = v;
    // Wide layers wrap into sub-columns of at most R rows, so a 1000-task fan-out stays readable.
    const R = (this.rowsPerCol = Math.max(64, Math.ceil(Math.sqrt(m * 3))));
    this.layerX = [];
    let x = 0;
    for (const k of this.vLayers) { this.layerX.push(x); x += Math.ceil(Math.max(k, 1) / R) * COL_W + (GAP_X - NODE_W); }
    this.width = x - (GAP_X - NODE_W);
    this.X = new Float64Array(m);
    this.Y = new Float64Array(m);
    for (let v = 0; v < m; v++) {
      const l = this.vLayer[v], p = this.vPos[v], rows = Math.min(this.vLayers[l], R);
      this.X[v] = this.layerX[l] + Math.floor(p / R) * COL_W;
      this.Y[v] = ((p % R) - rows / 2) * GAP_Y;
    }
    this.redraw();
  }
  get nodeCount() { return this.vLayer.length; }
  // Groups of two or more tasks in a layer, biggest first, with their task counts (for the group bar).
  groupSizes() {
    const total = new Map();
    for (const m of this.layerGroups()) for (const [g, k] of m) if (k > 1) total.set(g, (total.get(g) || 0) + k);
    return [...total.entries()].sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
  }
  setCollapsed(groups) {
    this.collapsed = new Set(groups);
    if (this.selected !== null && this.vMembers[this.node[this.selected]]) this.selected = null;
    this.build();
    this.fit();  // the shape changed: show all of it
    if (this.onGroups) this.onGroups();
  }
  collapseAll() { this.setCollapsed(this.groupSizes().map(([g]) => g)); }
  expandAll() { this.setCollapsed([]); }
  toggleGroup(g) { const c = new Set(this.collapsed); if (c.has(g)) c.delete(g); else c.add(g); this.setCollapsed(c); }
  nodeXY(i) { const v = this.node[i]; return [this.X[v], this.Y[v]]; }
  // An edge from a's right side to b's left side; one that goes back (a cycle's, in a rejected job's graph)
  // arcs over the layers between instead of crossing its own nodes.
  edgePath(ax, ay, bx, by) {
    const { ctx } = this;
    ctx.moveTo(ax + NODE_W, ay);
    if (bx > ax) {
      const mx = (ax + NODE_W + bx) / 2;
      ctx.bezierCurveTo(mx, ay, mx, by, bx, by);
    } else {
      const lift = Math.min(ay, by) - NODE_H - 40 - 0.15 * (ax - bx);
      ctx.bezierCurveTo(ax + NODE_W + 60, lift, bx - 60, lift, bx, by);
    }
  }
  fit() {
    const tall = Math.min(Math.max(1, ...this.vLayers), this.rowsPerCol);
    const bw = Math.max(this.width, NODE_W), bh = tall * GAP_Y;
    const s = Math.min((this.w - 40) / bw, (this.h - 40) / bh, 1.5);
    this.sx = this.sy = s;
    this.tx = (this.w - bw * s) / 2;
    this.ty = this.h / 2;
    this.redraw();
  }
  markRun(id) {  // a TaskMarkedSucceeded arrived
    const i = this.index.get(id);
    if (i === undefined || this.markedRun.has(i)) return;
    this.markedRun.add(i);
    this.redraw();
  }
  setState(id, state) {
    const i = this.index.get(id);
    if (i === undefined || !state || this.states[i] === state) return;
    this.states[i] = state;
    this.redraw();
  }
  hit(x, y) {
    const [wx, wy] = this.toWorld(x, y);
    let l = -1;
    for (let lo = 0, hi = this.layerX.length - 1; lo <= hi;) {  // last layer starting left of wx
      const mid = (lo + hi) >> 1;
      if (this.layerX[mid] <= wx) { l = mid; lo = mid + 1; } else hi = mid - 1;
    }
    if (l < 0) return null;
    const col = Math.floor((wx - this.layerX[l]) / COL_W);
    if (wx - this.layerX[l] - col * COL_W > NODE_W) return null;
    const R = this.rowsPerCol, rows = Math.min(this.vLayers[l], R);
    const row = Math.round(wy / GAP_Y + rows / 2);
    for (const r of [row - 1, row, row + 1]) {
      if (r < 0 || r >= R) continue;
      const v = this.vGrid[l][col * R + r];
      if (v === undefined) continue;
      if (wy >= this.Y[v] - NODE_H / 2 && wy <= this.Y[v] + NODE_H / 2) return v;  // a node index
    }
    return null;
  }
  onClick(x, y) {
    const v = this.hit(x, y);
    if (v === null) return;
    if (this.vMembers[v]) { this.toggleGroup(this.group[this.vTask[v]]); return; }  // a group: expand it
    const i = this.vTask[v];
    this.selected = i;
    this.redraw();
    this.onSelect(this.data.ids[i]);
  }
  // A collapsed group's tasks by state, in the order the colours are drawn.
  memberCounts(members) {
    const c = new Map();
    for (const i of members) c.set(this.states[i], (c.get(this.states[i]) || 0) + 1);
    return [...c.entries()].sort((a, b) => TASK_STATES.indexOf(b[0]) - TASK_STATES.indexOf(a[0]));
  }
  hoverText(x, y) {
    const v = this.hit(x, y);
    if (v === null) return null;
    const mem = this.vMembers[v], i = this.vTask[v];
    if (mem) return `${this.group[i]} ×${mem.length} (collapsed)\n${this.memberCounts(mem).map(([st, k]) => `${st} ${k}`).join(", ")}\nclick to expand`;
    if (this.rejected) return `${this.data.ids[i]}\n${this.states[i] === "missing" ? "not defined in the spec" : this.markedTasks.has(i) ? "named by the rejection" : "as submitted"}`;
    return `${this.data.ids[i]}\n${this.states[i]}${this.markedRun.has(i) ? " (marked by an operator, not run)" : ""}`;
  }
  // The critical path: the chain of tasks whose attempt times add up to the longest, by the layers'
  // topological order (a parent is always in an earlier layer). O(tasks + edges), once per attempts load.
  setCritical(attempts, nowMs) {
    const n = this.data.ids.length, dur = new Float64Array(n);
    for (const a of attempts) {
      const i = this.index.get(a.task_id);
      if (i !== undefined && a.started_ms != null) dur[i] += (a.ended_ms ?? nowMs) - a.started_ms;
    }
    const order = [...Array(n).keys()].sort((a, b) => this.data.layer[a] - this.data.layer[b]);
    const parents = Array.from({ length: n }, () => []);
    const e = this.data.edges;
    for (let k = 0; k < e.length; k += 2) parents[e[k + 1]].push(e[k]);
    const dist = new Float64Array(n), via = new Int32Array(n).fill(-1);
    for (const i of order) {
      let best = 0;
      for (const p of parents[i]) if (dist[p] > best || (via[i] < 0 && dist[p] >= best)) { best = dist[p]; via[i] = p; }
      dist[i] = best + dur[i];
    }
    let end = -1;
    for (let i = 0; i < n; i++) if (end < 0 || dist[i] > dist[end]) end = i;
    const path = [];
    for (let i = end; i >= 0 && dur.some((d) => d > 0); i = via[i]) path.push(i);
    this.critical = new Set(path);
    this.criticalIds = path.reverse().map((i) => this.data.ids[i]);
    this.redraw();
  }
  // Groups of a layer by task-name prefix (mProject_ID0000001 -> mProject): computed once per load.
  layerGroups() {
    if (this._groups) return this._groups;
    const groups = this.data.layers.map(() => new Map());
    this.data.ids.forEach((id, i) => {
      const prefix = this.group[i];
      const g = groups[this.data.layer[i]];
      g.set(prefix, (g.get(prefix) || 0) + 1);
    });
    return (this._groups = groups);
  }
  // At fit zoom the boxes are too small to carry their IDs: each layer gets a readable header instead,
  // its groups ("mProject ×12"), in screen pixels whatever the zoom.
  drawGroups(x0, x1) {
    const { ctx } = this;
    const groups = this.layerGroups();
    ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    ctx.font = "600 11px system-ui, sans-serif";
    ctx.textBaseline = "top";
    for (let l = 0; l < groups.length; l++) {
      const lx = this.layerX[l];
      const cols = Math.ceil(Math.max(this.vLayers[l], 1) / this.rowsPerCol);
      if (lx + cols * COL_W < x0 || lx > x1) continue;
      const [sx] = this.toScreen(lx, 0);
      const room = Math.max(cols * COL_W * this.sx, (GAP_X - NODE_W + NODE_W) * this.sx) - 4;
      if (room < 24) continue;
      let y = 6;
      for (const [prefix, n] of [...groups[l].entries()].sort((a, b) => b[1] - a[1]).slice(0, 3)) {
        let text = n > 1 ? `${prefix} \u00d7${n}` : prefix;
        while (text.length > 2 && ctx.measureText(text).width > room - 6) text = text.slice(0, -2) + "\u2026";
        if (ctx.measureText(text).width > room - 6) continue;  // no room even for "m…": leave it to hover
        ctx.fillStyle = "rgba(255,255,255,0.85)";
        const w = Math.min(ctx.measureText(text).width + 6, room);
        ctx.fillRect(sx - 2, y - 1, w, 14);
        ctx.fillStyle = "#1f2933";
        ctx.fillText(text, sx + 1, y, room - 6);
        y += 15;
        this.groupLabels++;
      }
    }
  }
  screenPos(id) {
    const i = this.index.get(id);
    if (i === undefined) return null;
    const [x, y] = this.nodeXY(i);
    const [sx, sy] = this.toScreen(x + NODE_W / 2, y);
    const r = this.canvas.getBoundingClientRect();
    return { x: r.left + sx, y: r.top + sy };
  }
  focus(id) {
    const i = this.index.get(id);
    if (i === undefined) return;
    const [x, y] = this.nodeXY(i);
    this.sx = this.sy = Math.max(this.sx, 1);
    this.tx = this.w / 2 - (x + NODE_W / 2) * this.sx;
    this.ty = this.h / 2 - y * this.sy;
    this.redraw();
  }
  draw() {
    const { ctx, data } = this;
    ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    ctx.clearRect(0, 0, this.w, this.h);
    ctx.setTransform(this.sx * this.dpr, 0, 0, this.sy * this.dpr, this.tx * this.dpr, this.ty * this.dpr);
    const [x0, y0] = this.toWorld(0, 0), [x1, y1] = this.toWorld(this.w, this.h);
    const visible = (x, y) => x + NODE_W >= x0 && x <= x1 && y + NODE_H >= y0 && y - NODE_H <= y1;
    // edges between drawn nodes: one path, thin; skipped when both ends are off screen on the same side
    const e = data.edges, ve = this.vEdges, X = this.X, Y = this.Y, node = this.node;
    ctx.beginPath();
    let drawn = 0;
    for (let k = 0; k < ve.length && drawn < 200000; k += 2) {
      const ax = X[ve[k]], ay = Y[ve[k]], bx = X[ve[k + 1]], by = Y[ve[k + 1]];
      if ((ax + NODE_W < x0 && bx < x0) || (ax > x1 && bx > x1) || (ay < y0 && by < y0) || (ay > y1 && by > y1)) continue;
      this.edgePath(ax, ay, bx, by);
      drawn++;
    }
    ctx.strokeStyle = "rgba(100,116,139,0.45)";
    ctx.lineWidth = 1 / this.sx;
    ctx.stroke();
    this.drawnMarked = 0;
    if (this.markedEdges.size) {  // a rejected job: the cycle's edges, the dependency on an unknown task
      ctx.beginPath();
      const n = data.ids.length;
      for (let k = 0; k < e.length; k += 2) {
        if (!this.markedEdges.has(e[k] * n + e[k + 1]) || (node[e[k]] === node[e[k + 1]] && e[k] !== e[k + 1])) continue;
        const [ax, ay] = this.nodeXY(e[k]), [bx, by] = this.nodeXY(e[k + 1]);
        this.edgePath(ax, ay, bx, by);
        this.drawnMarked++;
      }
      ctx.strokeStyle = MARK_COLOR; ctx.lineWidth = 3 / this.sx; ctx.stroke();
    }
    // nodes grouped by state: one fill per colour; a collapsed group as a bar of its tasks' states
    const byState = new Map();
    const shown = [], groups = [];
    for (let v = 0; v < X.length; v++) {
      const x = X[v], y = Y[v];
      if (!visible(x, y)) continue;
      shown.push(v);
      if (this.vMembers[v]) { groups.push(v); continue; }
      const s = this.states[this.vTask[v]];
      if (!byState.has(s)) byState.set(s, []);
      byState.get(s).push(v);
    }
    this.drawnNodes = shown.length;
    for (const [s, nodes] of byState) {
      ctx.beginPath();
      for (const v of nodes) ctx.rect(X[v], Y[v] - NODE_H / 2, NODE_W, NODE_H);
      ctx.fillStyle = s === "missing" ? "#fff" : STATE_COLORS[s] || "#999";
      ctx.fill();
    }
    if (groups.length) {
      for (const v of groups) {
        const mem = this.vMembers[v];
        let x = X[v];
        for (const [st, k] of this.memberCounts(mem)) {
          const w = (NODE_W * k) / mem.length;
          ctx.fillStyle = STATE_COLORS[st] || "#999";
          ctx.fillRect(x, Y[v] - NODE_H / 2, w, NODE_H);
          x += w;
        }
      }
      ctx.beginPath();  // a group's frame: thicker, so it reads as "more inside"
      for (const v of groups) ctx.rect(X[v], Y[v] - NODE_H / 2, NODE_W, NODE_H);
      ctx.strokeStyle = "#1f2933"; ctx.lineWidth = 2 / this.sx; ctx.stroke();
    }
    if (this.rejected) {  // tasks the rejection names: red outline; named but not defined: dashed
      for (const [set, dash] of [[this.markedTasks, []], [new Set(this.rejected.missing_tasks), [4 / this.sx, 3 / this.sx]]]) {
        if (!set.size) continue;
        ctx.beginPath();
        for (const i of set) { const [x, y] = this.nodeXY(i); ctx.rect(x, y - NODE_H / 2, NODE_W, NODE_H); }
        ctx.setLineDash(dash); ctx.strokeStyle = MARK_COLOR; ctx.lineWidth = 2 / this.sx; ctx.stroke();
      }
      ctx.setLineDash([]);
    }
    if (this.markedRun.size) {  // marked succeeded, not run: a dark dashed outline over the succeeded colour
      ctx.beginPath();
      for (const i of this.markedRun) { const [x, y] = this.nodeXY(i); ctx.rect(x, y - NODE_H / 2, NODE_W, NODE_H); }
      ctx.setLineDash([3 / this.sx, 2 / this.sx]); ctx.strokeStyle = "#4b5563"; ctx.lineWidth = 2 / this.sx; ctx.stroke();
      ctx.setLineDash([]);
    }
    if (this.critical && this.critical.size > 1) {  // the critical path: its edges and nodes outlined
      ctx.beginPath();
      for (let k = 0; k < e.length; k += 2) {
        if (!this.critical.has(e[k]) || !this.critical.has(e[k + 1]) || node[e[k]] === node[e[k + 1]]) continue;
        const [ax, ay] = this.nodeXY(e[k]), [bx, by] = this.nodeXY(e[k + 1]);
        const mx = (ax + NODE_W + bx) / 2;
        ctx.moveTo(ax + NODE_W, ay); ctx.bezierCurveTo(mx, ay, mx, by, bx, by);
      }
      for (const i of this.critical) { const [x, y] = this.nodeXY(i); ctx.rect(x, y - NODE_H / 2, NODE_W, NODE_H); }
      ctx.strokeStyle = "#f59e0b"; ctx.lineWidth = 2.5 / this.sx; ctx.stroke();
    }
    if (this.selected !== null) {
      const [x, y] = this.nodeXY(this.selected);
      ctx.lineWidth = 3 / this.sx; ctx.strokeStyle = "#111827";
      ctx.strokeRect(x - 2 / this.sx, y - NODE_H / 2 - 2 / this.sx, NODE_W + 4 / this.sx, NODE_H + 4 / this.sx);
    }
    this.groupLabels = 0;
    if (NODE_H * this.sy < 11 || shown.length > 3000) this.drawGroups(x0, x1);  // too small for node labels
    if (NODE_H * this.sy >= 11 && shown.length <= 3000) {
      // labels in screen pixels (9-12 px as the boxes allow), so a zoomed-out graph stays readable
      ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
      const fs = Math.floor(Math.max(9, Math.min(12, NODE_H * this.sy - 2))), room = NODE_W * this.sx;
      ctx.font = `${fs}px system-ui, sans-serif`;
      ctx.textBaseline = "middle";
      for (const v of shown) {
        const [x, y] = this.toScreen(X[v], Y[v]), i = this.vTask[v], mem = this.vMembers[v];
        const s = this.states[i];
        if (mem) {  // a group: name and size on a plate, readable over any state colour
          const label = `\u25b8 ${this.group[i]} \u00d7${mem.length}`;
          ctx.fillStyle = "rgba(255,255,255,0.85)";
          ctx.fillRect(x + 3, y - fs / 2 - 1, Math.min(ctx.measureText(label).width + 6, room - 6), fs + 2);
          ctx.fillStyle = "#1f2933";
          ctx.fillText(label, x + 6, y + 0.5, room - 12);
          continue;
        }
        ctx.fillStyle = s === "pending" || s === "runnable" || s === "missing" ? "#1f2933" : "#fff";
        let label = data.ids[i];
        if (label.length > 22) label = label.slice(0, 21) + "\u2026";
        ctx.fillText(label, x + 5, y + 0.5, room - 8);
      }
    }
  }
}

// -- the timeline (Gantt of attempts) --------------------------------------------------------
const ROW_H = 16, GUTTER = 170;  // the Gantt's row axis: task names

class Timeline extends PanZoom {
  constructor(canvas, onSelect) {
    super(canvas, { zoomY: false });
    this.onSelect = onSelect;
    this.rows = []; this.lines = []; this.groupBy = ""; this.t0 = 0; this.t1 = 1;
  }
  /* Rows: one a task (`rows`: task names in row order). Grouped (`groupBy` "worker" or "type"), `lines`
   * interleaves a header line before each group's rows: by worker, a row is a (worker, task) pair, so a task
   * retried on another worker has a row under each; by type, the group is the graph's taskGroup (name
   * prefix). Groups and rows within them are ordered by first start. O(attempts log attempts) a load. */
  load(attempts, nowMs) {
    this.attempts = attempts; this.nowMs = nowMs;
    const by = this.groupBy, started = attempts.filter((a) => a.started_ms != null);
    const groupOf = by === "worker" ? (a) => a.worker_id || "(no worker)" : by === "type" ? (a) => taskGroup(a.task_id) : null;
    const keyOf = by === "worker" ? (a) => `${groupOf(a)}\u0000${a.task_id}` : (a) => a.task_id;
    const first = new Map(), groupFirst = new Map();
    for (const a of started) {
      const k = keyOf(a), f = first.get(k);
      if (f === undefined || a.started_ms < f) first.set(k, a.started_ms);
      if (groupOf) { const g = groupOf(a), gf = groupFirst.get(g); if (gf === undefined || a.started_ms < gf) groupFirst.set(g, a.started_ms); }
    }
    const byStart = (m) => (a, b) => m.get(a) - m.get(b) || (a < b ? -1 : 1);
    const keys = [...first.keys()].sort(byStart(first)), taskOf = new Map(started.map((a) => [keyOf(a), a.task_id]));
    const lines = [];
    if (groupOf) {
      const members = new Map([...groupFirst.keys()].sort(byStart(groupFirst)).map((g) => [g, []]));
      const groupOfKey = new Map(started.map((a) => [keyOf(a), groupOf(a)]));
      for (const k of keys) members.get(groupOfKey.get(k)).push(k);
      for (const [g, ks] of members) {
        lines.push({ header: g, count: ks.length });
        for (const k of ks) lines.push({ key: k, task: taskOf.get(k), group: g });
      }
    } else for (const k of keys) lines.push({ key: k, task: k });
    const row = new Map();
    lines.forEach((l, i) => { if (l.key !== undefined) row.set(l.key, i); });
    this.lines = lines;
    this.rows = lines.filter((l) => l.task !== undefined).map((l) => l.task);
    this.bars = started.map((a) => ({
      row: row.get(keyOf(a)), task: a.task_id, attempt: a.attempt, s: a.started_ms,
      e: a.ended_ms ?? nowMs, outcome: a.outcome, worker: a.worker_id, reason: a.reason,
    }));
    this.t0 = Math.min(...this.bars.map((b) => b.s), nowMs);
    this.t1 = Math.max(...this.bars.map((b) => b.e), this.t0 + 1);
    if (!this.touched && this.bars.length) this.fit();  // follow the job until the user zooms or pans
    this.redraw();
  }
  setGroupBy(by) {
    this.groupBy = by === "worker" || by === "type" ? by : "";
    this.touched = false;
    if (this.attempts) this.load(this.attempts, this.nowMs);
  }
  fit() {
    const span = Math.max(this.t1 - this.t0, 1);
    this.sx = (this.w - GUTTER - 40) / span; this.tx = GUTTER + 10 - this.t0 * this.sx;
    this.sy = Math.min(1, (this.h - 30) / Math.max(1, this.lines.length * ROW_H)); this.ty = 24;
    this.redraw();
  }
  barAt(x, y) {
    const [t] = this.toWorld(x, 0);
    const r = Math.floor((y - this.ty) / (ROW_H * this.sy));
    const tol = 3 / this.sx;
    return (this.bars || []).find((b) => b.row === r && t >= b.s - tol && t <= b.e + tol) || null;
  }
  rowAt(y) { const r = Math.floor((y - this.ty) / (ROW_H * this.sy)); return r >= 0 && r < this.lines.length ? r : -1; }
  onClick(x, y) {
    if (x < GUTTER) { const r = this.rowAt(y); if (r >= 0 && this.lines[r].task !== undefined) this.onSelect(this.lines[r].task); return; }
    const b = this.barAt(x, y); if (b) this.onSelect(b.task);
  }
  hoverText(x, y) {
    const b = this.barAt(x, y);
    if (!b) return null;
    return `${b.task} #${b.attempt} ${b.outcome}\n${fmtDur(b.e - b.s)} on ${b.worker || "?"}${b.reason ? "\n" + b.reason : ""}`;
  }
  draw() {
    const { ctx } = this;
    ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    ctx.clearRect(0, 0, this.w, this.h);
    if (!this.bars || !this.bars.length) {
      ctx.fillStyle = "#6b7785"; ctx.font = "13px system-ui"; ctx.fillText("no attempt started yet", 16, 30);
      return;
    }
    // time axis
    const [ta] = this.toWorld(0, 0), [tb] = this.toWorld(this.w, 0);
    const span = tb - ta;
    const steps = [10, 50, 100, 500, 1000, 5000, 10000, 30000, 60000, 300000, 600000, 1800000, 3600000];
    const step = steps.find((s) => span / s <= 10) || 7200000;
    ctx.fillStyle = "#6b7785"; ctx.font = "11px system-ui"; ctx.strokeStyle = "#e5e7eb"; ctx.lineWidth = 1;
    for (let t = this.t0 + Math.max(0, Math.ceil((ta - this.t0) / step)) * step; t <= tb; t += step) {
      const x = t * this.sx + this.tx;
      ctx.beginPath(); ctx.moveTo(x, 16); ctx.lineTo(x, this.h); ctx.stroke();
      ctx.fillText(`+${fmtDur(t - this.t0)}`, x + 3, 12);
    }
    const rh = ROW_H * this.sy;
    const firstRow = Math.max(0, Math.floor((16 - this.ty) / rh));
    const lastRow = Math.min(this.lines.length, Math.ceil((this.h - this.ty) / rh));
    ctx.fillStyle = "#eef1f5";  // group header lines: a band across the chart
    for (let r = firstRow; r < lastRow; r++) if (this.lines[r].header !== undefined) ctx.fillRect(GUTTER, r * rh + this.ty, this.w - GUTTER, rh);
    for (const b of this.bars) {
      if (b.row < firstRow || b.row > lastRow) continue;
      const x = b.s * this.sx + this.tx, w = Math.max((b.e - b.s) * this.sx, 2);
      if (x > this.w || x + w < 0) continue;
      const y = b.row * rh + this.ty;
      ctx.fillStyle = OUTCOME_COLORS[b.outcome] || "#999";
      ctx.fillRect(x, y + rh * 0.12, w, Math.max(rh * 0.76, 1));
      if (w > 60 && rh >= 12) { ctx.fillStyle = "#fff"; ctx.fillText(`${b.task} #${b.attempt}`, x + 4, y + rh - 5, w - 8); }
    }
    // the row axis, drawn over bars panned under it: one task name a row when rows are tall enough to read
    ctx.fillStyle = "#fbfcfd"; ctx.fillRect(0, 0, GUTTER, this.h);
    ctx.strokeStyle = "#e1e5ea"; ctx.beginPath(); ctx.moveTo(GUTTER + 0.5, 0); ctx.lineTo(GUTTER + 0.5, this.h); ctx.stroke();
    this.rowLabels = 0; this.headerLabels = 0;
    if (rh >= 9) {
      const size = Math.min(12, Math.floor(rh - 2)), grouped = !!this.groupBy;
      ctx.textBaseline = "middle";
      for (let r = firstRow; r < lastRow; r++) {
        const l = this.lines[r], y = r * rh + this.ty + rh / 2;
        if (l.header !== undefined) {
          ctx.fillStyle = "#eef1f5"; ctx.fillRect(0, r * rh + this.ty, GUTTER, rh);
          ctx.fillStyle = "#1f2933"; ctx.font = `600 ${size}px system-ui`;
          ctx.fillText(`${l.header} (${l.count})`, 6, y, GUTTER - 12);
          this.headerLabels++;
        } else {
          ctx.fillStyle = "#1f2933"; ctx.font = `${size}px system-ui`;
          ctx.fillText(l.task, grouped ? 16 : 6, y, GUTTER - (grouped ? 22 : 12));
          this.rowLabels++;
        }
      }
      ctx.textBaseline = "alphabetic";
    } else {
      ctx.fillStyle = "#6b7785"; ctx.font = "11px system-ui";
      ctx.fillText(`${this.rows.length} tasks: zoom to read`, 6, 30, GUTTER - 12);
    }
  }
}

// -- the grid (tasks x attempts, as Airflow's Grid): one row per task, one cell per attempt ----------------
const GRID_MAX_ROWS = 5000;

function renderGrid(box, attempts, onSelect) {
  const byTask = new Map();
  let most = 1;
  for (const a of attempts) {
    if (!byTask.has(a.task_id)) byTask.set(a.task_id, []);
    const list = byTask.get(a.task_id);
    list[a.attempt - 1] = a;
    most = Math.max(most, a.attempt);
  }
  const tasks = [...byTask.keys()].slice(0, GRID_MAX_ROWS);
  const head = `<tr><th>task</th>${Array.from({ length: most }, (_, i) => `<th class="num">#${i + 1}</th>`).join("")}</tr>`;
  const rows = tasks.map((t) => `<tr data-task="${esc(t)}"><td class="mono">${esc(t)}</td>${Array.from({ length: most }, (_, i) => {
    const a = byTask.get(t)[i];
    if (!a) return "<td></td>";
    const tip = `${a.outcome}${a.duration_ms != null ? " · " + fmtDur(a.duration_ms) : ""}${a.reason ? " · " + a.reason : ""}`;
    return `<td><i class="cell" title="${esc(tip)}" style="background:${OUTCOME_COLORS[a.outcome] || "#999"}"></i></td>`;
  }).join("")}</tr>`).join("");
  const more = byTask.size > tasks.length ? `<p class="muted small">first ${tasks.length} of ${byTask.size} tasks</p>` : "";
  box.innerHTML = `${more}<table class="grid-table"><thead>${head}</thead><tbody>${rows}</tbody></table>`;
  box.querySelectorAll("tr[data-task]").forEach((tr) => tr.addEventListener("click", () => onSelect(tr.dataset.task)));
  hooks.gridRows = tasks.length;
}

// -- pages ---------------------------------------------------------------------------------
function jobRow(j) {
  return `<tr data-job="${esc(j.job_id)}">
    <td class="mono"><a href="#/jobs/${enc(j.job_id)}">${esc(j.job_id)}</a>${j.name ? `<div class="small"><b>${esc(j.name)}</b></div>` : j.labels && j.labels.workflow ? `<div class="muted small">${esc(j.labels.workflow)}</div>` : ""}</td>
    <td>${esc(j.tenant)}</td><td>${badge(j.state)}</td>
    <td style="min-width:120px">${stackBar(j)}<span class="small muted">${(j.progress || 0).toFixed(0)}% of ${j.total_tasks}</span></td>
    <td class="small">${fmtTime(j.created_ms)}</td><td class="small num">${fmtDur(j.duration_ms)}</td>
    <td class="small">${esc(j.code ? `${j.code}: ` : "")}${esc(j.reason || "")}</td></tr>`;
}

async function pageJobs(params, signal) {
  const state = params.get("state") || "", tenant = params.get("tenant") || "";
  view.innerHTML = `<h1>Jobs</h1>
    <div class="filters">
      <label>state <select id="f-state"><option value="">any</option>${JOB_STATES.map((s) => `<option ${s === state ? "selected" : ""}>${s}</option>`).join("")}</select></label>
      <label>tenant <input id="f-tenant" value="${esc(tenant)}" placeholder="any" size="12"></label>
      <span class="muted small" id="jobs-count"></span>
    </div>
    <div id="jobs-body"></div>`;
  const apply = () => {
    const q = new URLSearchParams();
    if ($("#f-state").value) q.set("state", $("#f-state").value);
    if ($("#f-tenant").value.trim()) q.set("tenant", $("#f-tenant").value.trim());
    location.hash = `#/jobs${q.toString() ? "?" + q : ""}`;
  };
  $("#f-state").addEventListener("change", apply);
  $("#f-tenant").addEventListener("change", apply);
  let limit = 100;
  const load = async () => {
    const q = new URLSearchParams({ limit: String(limit) });
    if (state) q.set("state", state);
    if (tenant) q.set("tenant", tenant);
    try {
      const page = await api(`/v1/jobs?${q}`);
      if (signal.aborted) return;
      $("#jobs-count").textContent = `${page.jobs.length}${page.next_cursor ? "+" : ""} jobs`;
      $("#jobs-body").innerHTML = page.jobs.length
        ? `<table id="jobs-table"><thead><tr><th>job</th><th>tenant</th><th>state</th><th>progress</th><th>created</th><th class="num">duration</th><th>reason</th></tr></thead><tbody>${page.jobs.map(jobRow).join("")}</tbody></table>
           ${page.next_cursor ? `<p><button id="more">show more</button></p>` : ""}`
        : `<div class="empty">No jobs yet. Submit one: <code>dagfold submit examples/diamond.yaml</code></div>`;
      const more = $("#more");
      if (more) more.addEventListener("click", () => { limit = Math.min(limit * 2, 1000); load(); });
      hooks.ready = true;
    } catch (e) { $("#jobs-body").innerHTML = errorBox(e); }
  };
  await load();
  const timer = setInterval(load, 2000);
  signal.addEventListener("abort", () => clearInterval(timer));
}

function countsChips(job) {
  return TASK_STATES.map((s) => `<span class="chip" data-state="${s}"><i style="background:${STATE_COLORS[s]}"></i>${s} <b>${job.counts[s] || 0}</b></span>`).join("");
}

/* A job's buttons, one row each (POST /v1/jobs/<id>/<action>): the job states it is offered in (the lifecycle's
   rules, dagfold.lifecycle; the API's 409 says why otherwise), its label and tooltip; "confirm" asks first, and
   the page follows the job again after it unless "stay". */
const JOB_ACTIONS = [
  { action: "pause", label: "Pause", when: (s) => s === "running", title: "nothing new is dispatched; running tasks finish" },
  { action: "resume", label: "Resume", when: (s) => s === "paused", title: "dispatch what became runnable while paused" },
  { action: "cancel", label: "Cancel", when: (s) => !TERMINAL.has(s), danger: true, confirm: (id) => `Cancel job ${id}?`, stay: true },
  { action: "redrive", label: "Redrive", when: (s) => ["failed", "succeeded_partial", "cancelled"].includes(s) },
];

function jobHeader(job) {
  const buttons = JOB_ACTIONS.filter((a) => a.when(job.state)).map((a) =>
    `<button${a.danger ? ` class="danger"` : ""} id="btn-${a.action}"${a.title ? ` title="${esc(a.title)}"` : ""}>${a.label}</button>`);
  return `<div class="row job-head" style="align-items:center">
      <h1 class="grow mono job-title" style="margin:0">${job.name ? `<span class="job-name">${esc(job.name)}</span> ` : ""}${esc(job.job_id)} <span id="job-state">${badge(job.state)}</span></h1>
      ${buttons.join("\n      ")}
    </div>
    <div class="muted small">tenant <b>${esc(job.tenant)}</b> · tier ${esc(job.tier)} · policy ${esc(job.failure_policy)} ·
      created ${fmtTime(job.created_ms)}${job.duration_ms != null ? ` · took ${fmtDur(job.duration_ms)}` : ""} · retries ${job.retries || 0}
      ${job.trace_url ? ` · <a id="job-trace" href="${esc(job.trace_url)}" target="_blank" rel="noopener noreferrer" title="this job's trace (OpenTelemetry)">trace</a>` : ""}
      ${job.redrives ? ` · redriven ${job.redrives}×` : ""}${job.redispatches ? ` · <span id="job-redispatches" title="dispatch records sent again: no worker had taken the task in time">re-dispatched ${job.redispatches}×</span>` : ""}</div>
    <div class="row" style="align-items:center;margin-top:6px"><div class="grow">${stackBar(job)}</div><span class="small">${(job.progress || 0).toFixed(1)}% of ${job.total_tasks} tasks</span></div>
    <div class="chips" id="counts">${countsChips(job)}</div>
    ${job.reason ? `<div class="${job.state === "failed" || job.state === "rejected" ? "error-box" : "muted"}" id="job-reason">${esc(job.code ? job.code + ": " : "")}${esc(job.reason)}</div>` : ""}`;
}

/* The task groups (name prefixes with two or more tasks in a layer) as toggles above the graph: a
 * pressed one is drawn as one node a layer. Hidden for a graph without groups. */
const GROUP_BAR_MAX = 40;
function groupBar(graph) {
  const sizes = graph.groupSizes(), box = $("#dag-groups");
  box.hidden = !sizes.length;
  $("#dag-collapse").hidden = !sizes.length || sizes.every(([g]) => graph.collapsed.has(g));
  $("#dag-expand").hidden = !graph.collapsed.size;
  if (!sizes.length) return;
  const more = sizes.length > GROUP_BAR_MAX ? ` <span class="muted">and ${sizes.length - GROUP_BAR_MAX} more</span>` : "";
  box.innerHTML = `<span class="muted">groups</span> ${sizes.slice(0, GROUP_BAR_MAX).map(([g, k]) =>
    `<button type="button" class="chip${graph.collapsed.has(g) ? " on" : ""}" data-group="${esc(g)}" aria-pressed="${graph.collapsed.has(g)}" title="${graph.collapsed.has(g) ? "expand" : "collapse"} ${esc(g)}">${esc(g)} <b>${k}</b></button>`).join("")}${more}
    <span class="muted">· ${graph.nodeCount.toLocaleString()} nodes drawn for ${graph.data.ids.length.toLocaleString()} tasks</span>`;
}

/* Above a rejected job's graph: what is drawn (the spec as submitted, bounded) and what the red marks are. */
function rejectedNote(g) {
  const rj = g.rejected;
  if (!rj) return `<div class="muted small" id="rejected-note">This job was rejected before its graph was recorded (an event from before the field).</div>`;
  const shown = g.ids.length < rj.total_tasks ? ` · showing ${g.ids.length.toLocaleString()} of ${rj.total_tasks.toLocaleString()} tasks (those the rejection names and their neighbours first)` : "";
  const what = [rj.marked_edges.length ? `<b style="color:${MARK_COLOR}">red edges</b>: the offending dependencies` : "",
    rj.marked_tasks.length ? `red outline: the tasks the reason names` : "",
    rj.missing_tasks.length ? `dashed: named as a dependency but not defined` : ""].filter(Boolean).join(" · ");
  return `<div class="small" id="rejected-note">The graph as submitted${what ? `: ${what}` : ""}${shown}.</div>`;
}

/* Operator decisions on one task (docs/semantics.md#retry-or-mark-succeeded-one-task): the rules the API and
   the scheduler apply (dagfold.lifecycle), here only to offer the buttons; the API's 409 says why otherwise. */
const TASK_ACTION_JOB_STATES = new Set(["running", "failed", "succeeded_partial"]);
const TASK_ACTION_TASK_STATES = new Set(["failed", "skipped", "cancelled"]);
const TASK_ACTIONS = {
  retry: { label: "Retry task", path: "retry", done: "retry requested",
    explain: (t) => `Run ${t} again with a fresh retry budget? The tasks it skipped downstream run again too, and the job runs again.` },
  "mark-succeeded": { label: "Mark succeeded", path: "mark-succeeded", done: "mark succeeded requested",
    explain: (t) => `Record ${t} as succeeded without running it? Its downstream tasks then run. The history says who marked it.` },
};

function taskActionsHtml(job, t) {
  if (!TASK_ACTION_JOB_STATES.has(job.state) || !TASK_ACTION_TASK_STATES.has(t.state)) return "";
  return `<div id="task-actions" class="row" style="gap:6px;margin:8px 0">
      <button type="button" data-task-action="retry" id="btn-task-retry">${TASK_ACTIONS.retry.label}</button>
      <button type="button" data-task-action="mark-succeeded" id="btn-task-mark">${TASK_ACTIONS["mark-succeeded"].label}</button>
    </div><div id="task-action-box"></div>`;
}

/* The buttons of the task panel: a click asks to confirm (with an optional reason), the confirm sends the
   command, then the panel follows the task until the scheduler has decided (or says where to look). */
function bindTaskActions(box, jobId, t, onChange) {
  const area = $("#task-action-box", box);
  if (!area) return;
  for (const b of box.querySelectorAll("[data-task-action]")) {
    b.addEventListener("click", () => {
      const act = TASK_ACTIONS[b.dataset.taskAction];
      area.innerHTML = `<div class="panel" id="task-confirm" style="margin:6px 0">
          <div class="small">${esc(act.explain(t.task_id))}</div>
          <input id="task-action-reason" maxlength="2000" placeholder="reason (optional, kept in the history)" style="width:100%;margin:6px 0;padding:4px 6px">
          <div class="row" style="gap:6px"><button type="button" id="task-confirm-yes">${esc(act.label)}</button>
          <button type="button" class="link" id="task-confirm-no" style="color:inherit">back</button></div></div>`;
      $("#task-confirm-no", area).addEventListener("click", () => { area.innerHTML = ""; });
      $("#task-confirm-yes", area).addEventListener("click", async () => {
        const reason = $("#task-action-reason", area).value;
        for (const x of box.querySelectorAll("button")) x.disabled = true;
        try {
          await api(`/v1/jobs/${enc(jobId)}/tasks/${enc(t.task_id)}/${act.path}`, {
            method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ reason }) });
          area.innerHTML = `<div class="small muted" id="task-action-status">${esc(act.done)}; waiting for the scheduler…</div>`;
          awaitTaskChange(box, jobId, t, onChange);
        } catch (e) {
          area.innerHTML = `<div class="error-box" id="task-action-error">${esc(e.message || e)}</div>`;
          for (const x of box.querySelectorAll("button")) x.disabled = false;
        }
      });
      $("#task-action-reason", area).focus();
    });
  }
}

async function awaitTaskChange(box, jobId, t, onChange) {
  const deadline = Date.now() + 20000;
  while (Date.now() < deadline && box.isConnected && box.dataset.task === t.task_id) {
    await new Promise((r) => setTimeout(r, 400));
    try {
      const now = await api(`/v1/jobs/${enc(jobId)}/tasks/${enc(t.task_id)}`);
      if (now.state !== t.state || now.attempt !== t.attempt) {  // decided: the job page follows the job again
        if (onChange) onChange();
        showTask(jobId, t.task_id, onChange);
        return;
      }
    } catch (e) { /* try again */ }
  }
  const st = $("#task-action-status", box);
  if (st) st.textContent = "no change yet: the job's history shows the scheduler's answer";
}

/* ``onChange``: what the job page does once an action here changed the task (follow the job's events again:
   a finished job's stream had ended). */
async function showTask(jobId, taskId, onChange = null) {
  const box = $("#task-panel");
  if (!box) return;
  box.dataset.task = taskId;
  box.innerHTML = `<p class="muted">loading ${esc(taskId)}…</p>`;
  try {
    const [t, a, job] = await Promise.all([
      api(`/v1/jobs/${enc(jobId)}/tasks/${enc(taskId)}`),
      api(`/v1/jobs/${enc(jobId)}/tasks/${enc(taskId)}/attempts`),
      api(`/v1/jobs/${enc(jobId)}`),
    ]);
    if (box.dataset.task !== taskId) return;  // another task was clicked meanwhile
    const attempts = a.attempts.slice().reverse();
    const marked = t.state === "succeeded" && t.marked_by != null;
    box.innerHTML = `<h2 style="margin-top:0" class="mono" id="task-title">${esc(t.task_id)}</h2>
      ${taskActionsHtml(job, t)}
      <dl class="kv">
        <dt>state</dt><dd id="task-state">${badge(t.state)}${marked ? ` <span class="badge" id="task-marked" style="background:#4b5563" title="recorded as succeeded by an operator, not run">marked</span>` : ""}</dd>
        ${marked ? `<dt>marked by</dt><dd id="task-marked-by">${esc(t.marked_by || "an operator")}${t.marked_reason ? `: ${esc(t.marked_reason)}` : ""} <span class="muted small">(not run)</span></dd>` : ""}
        ${t.retried_by != null ? `<dt>retried by</dt><dd id="task-retried-by">${esc(t.retried_by || "an operator")}</dd>` : ""}
        <dt>attempt</dt><dd>${t.attempt}${t.retries ? ` (${t.retries} retries)` : ""}${t.redispatches ? ` <span class="muted small" id="task-redispatches">re-dispatched ${t.redispatches}×</span>` : ""}</dd>
        <dt>handler</dt><dd class="mono">${esc(t.handler)}</dd>
        <dt>queue</dt><dd>${esc(t.queue)}</dd>
        <dt>worker</dt><dd class="mono">${esc(t.worker_id || "")}</dd>
        <dt>depends on</dt><dd class="mono small">${t.depends_on.map(esc).join(", ") || "—"}</dd>
        ${t.reason ? `<dt>reason</dt><dd class="reason" id="task-reason">${esc(t.reason)}${exitNote(t.reason, t.exit_code)}${t.error_type ? ` [${esc(t.error_type)}]` : ""}</dd>` : ""}
        ${t.lease_deadline_ms ? `<dt>lease until</dt><dd>${fmtTime(t.lease_deadline_ms)}</dd>` : ""}
        ${t.progress != null ? `<dt>progress</dt><dd>${(t.progress * 100).toFixed(0)}%</dd>` : ""}
        ${t.gpu_state ? `<dt>GPU job</dt><dd id="task-gpu-state">${badge(t.gpu_state)}</dd>` : ""}
        ${(t.outputs || []).length ? `<dt>outputs</dt><dd id="task-outputs">${t.outputs.map((o) => `<div class="small"><a href="/v1/jobs/${enc(jobId)}/tasks/${enc(taskId)}/outputs/${o.name.split("/").map(enc).join("/")}">${esc(o.name)}</a> <span class="muted">${o.size} B · ${esc(o.content_type)} · sha256 ${esc(o.sha256.slice(0, 12))}…</span></div>`).join("")}</dd>` : ""}
      </dl>
      <h2>Attempts</h2>
      ${attempts.length ? attempts.map((x) => `<div class="panel" style="margin-bottom:8px" data-attempt="${x.attempt}">
        <div>#${x.attempt} ${badge(x.outcome)} <span class="small muted mono">${esc(x.worker_id || "")}</span>
          <span class="small muted">${fmtTime(x.started_ms)}${x.duration_ms != null ? ` · ${fmtDur(x.duration_ms)}` : ""}</span></div>
        ${x.reason ? `<div class="reason small">${esc(x.reason)}${exitNote(x.reason, x.exit_code)}</div>` : ""}
        ${x.stderr_tail ? `<div class="small muted">stderr</div><pre class="tail">${esc(x.stderr_tail)}</pre>` : ""}
        ${x.stdout_tail ? `<div class="small muted">stdout</div><pre class="tail">${esc(x.stdout_tail)}</pre>` : ""}
        ${x.result_json ? `<div class="small muted">result</div><pre class="tail">${esc(x.result_json)}</pre>` : ""}
      </div>`).join("") : `<p class="muted">not started</p>`}`;
    bindTaskActions(box, jobId, t, onChange);
  } catch (e) { box.innerHTML = errorBox(e); }
}

async function pageJob(jobId, signal, params = new URLSearchParams()) {
  view.innerHTML = `<p class="muted">loading job ${esc(jobId)}…</p>`;
  let job;
  try { job = await api(`/v1/jobs/${enc(jobId)}`); } catch (e) {
    view.innerHTML = `<p><a href="#/jobs">← jobs</a></p>${errorBox(e)}`;
    return;
  }
  view.innerHTML = `<p class="small"><a href="#/jobs">← jobs</a></p>
    <div id="job-head">${jobHeader(job)}</div>
    <div class="row" style="margin-top:10px">
      <div class="grow">
        <div class="dag-groups small" id="dag-groups" hidden></div>
        <div class="canvas-wrap"><canvas id="dag" style="height:560px"></canvas>
          <div class="canvas-tools"><button id="dag-collapse" type="button" title="draw each task group as one node a layer" hidden>collapse groups</button><button id="dag-expand" type="button" hidden>expand all</button><button id="dag-fit" type="button">fit</button></div>
          <div class="hint">scroll to zoom · drag to pan · click a task</div></div>
      </div>
      <div class="side panel" id="task-panel"><p class="muted">Click a task in the graph or the timeline to see its attempts and failure reasons.</p></div>
    </div>
    <h2>Grid <span class="muted small">tasks × attempts</span> <button id="grid-toggle" type="button" class="small">show</button></h2>
    <div id="grid" class="panel grid-view" hidden></div>
    <h2>Timeline</h2>
    <div class="canvas-wrap"><canvas id="gantt" style="height:300px"></canvas>
      <div class="canvas-tools"><label class="small">group rows by <select id="gantt-group"><option value="">none</option><option value="worker">worker</option><option value="type">task type</option></select></label><button id="gantt-fit" type="button">fit</button></div>
      <div class="hint">scroll to zoom time · shift+scroll to zoom rows · drag to pan · click an attempt</div></div>
    <h2>History <span class="muted small" id="hist-count"></span></h2>
    <div class="panel" style="max-height:360px;overflow:auto;padding:0"><table id="history"><thead><tr><th>time</th><th>event</th><th>task</th><th class="num">attempt</th><th>detail</th></tr></thead><tbody></tbody></table></div>`;
  const select = (tid) => { showTask(jobId, tid, () => restart()); const g = hooks.graph; if (g && g.index.has(tid)) { g.selected = g.index.get(tid); g.redraw(); } };
  const bindButtons = () => {
    for (const a of JOB_ACTIONS) {
      const b = $(`#btn-${a.action}`);
      if (b) b.addEventListener("click", async () => {
        if (a.confirm && !confirm(a.confirm(jobId))) return;
        try { await api(`/v1/jobs/${enc(jobId)}/${a.action}`, { method: "POST" }); if (!a.stay) restart(); } catch (e) { alert(e.message); }
      });
    }
  };
  bindButtons();
  // the view's choices live in the address (#/jobs/ID?groups=mProject&rows=worker): a view to share or reload
  const setParam = (key, value) => {
    if (value) params.set(key, value); else params.delete(key);
    const hash = `#/jobs/${enc(jobId)}${params.toString() ? "?" + params : ""}`;
    if (location.hash !== hash) history.replaceState(null, "", hash);  // no hashchange: the page stays
  };
  let graph = null, timeline = null;
  try {
    const g = await api(`/v1/jobs/${enc(jobId)}/graph`);
    if (signal.aborted) return;
    graph = new DagView($("#dag"), g, g.state === "rejected" ? () => {} : select);  // a refused spec has no tasks to show
    hooks.graph = graph;
    if (g.state === "rejected") $("#dag").parentElement.insertAdjacentHTML("beforebegin", rejectedNote(g));
    graph.onGroups = () => {
      groupBar(graph);
      setParam("groups", graph.collapsed.size ? [...graph.collapsed].join(",") : "");
    };
    if (params.get("groups")) graph.setCollapsed(params.get("groups").split(",").slice(0, 200));
    groupBar(graph);
    $("#dag-collapse").addEventListener("click", () => graph.collapseAll());
    $("#dag-expand").addEventListener("click", () => graph.expandAll());
    $("#dag-groups").addEventListener("click", (ev) => {
      const b = ev.target.closest("button[data-group]");
      if (b) graph.toggleGroup(b.dataset.group);
    });
    $("#dag-fit").addEventListener("click", () => graph.fit());
  } catch (e) { $("#dag").parentElement.outerHTML = errorBox(e); }
  timeline = new Timeline($("#gantt"), select);
  hooks.timeline = timeline;
  $("#gantt-fit").addEventListener("click", () => { timeline.touched = false; timeline.fit(); });
  const rowsBy = ["worker", "type"].includes(params.get("rows")) ? params.get("rows") : "";
  $("#gantt-group").value = rowsBy;
  timeline.setGroupBy(rowsBy);
  $("#gantt-group").addEventListener("change", (ev) => { timeline.setGroupBy(ev.target.value); setParam("rows", timeline.groupBy); });
  const onResize = () => { for (const v of [graph, timeline]) if (v) { v.resize(); v.redraw(); } };
  window.addEventListener("resize", onResize);

  let attemptsTimer = null, lastAttempts = [];
  $("#grid-toggle").addEventListener("click", () => {
    const g = $("#grid");
    g.hidden = !g.hidden;
    $("#grid-toggle").textContent = g.hidden ? "show" : "hide";
    if (!g.hidden) renderGrid(g, lastAttempts, select);
  });
  const loadAttempts = async () => {
    attemptsTimer = null;
    try {
      const all = [];
      let cursor = null;
      do {
        const page = await api(`/v1/jobs/${enc(jobId)}/attempts?limit=1000${cursor ? "&cursor=" + enc(cursor) : ""}`);
        all.push(...page.attempts);
        cursor = page.next_cursor;
      } while (cursor && all.length < 20000 && !signal.aborted);
      if (!signal.aborted) {
        timeline.load(all, Date.now());
        if (graph) graph.setCritical(all, Date.now());
        lastAttempts = all;
        if (!$("#grid").hidden) renderGrid($("#grid"), all, select);
      }
    } catch (e) { /* the next event retries */ }
  };
  const refreshAttempts = () => { if (!attemptsTimer) attemptsTimer = setTimeout(loadAttempts, 700); };
  loadAttempts();
  const tick = setInterval(() => { if (!TERMINAL.has(job.state)) refreshAttempts(); }, 3000);

  const tbody = $("#history tbody");
  let histCount = 0;
  const onEvent = (kind, data) => {
    if (kind === "history") {
      histCount++;
      if (graph && data.task_id && data.task_state) graph.setState(data.task_id, data.task_state);
      if (graph && data.type === "TaskMarkedSucceeded" && data.task_id) graph.markRun(data.task_id);
      if (data.type === "JobRedriven" || data.type === "JobAccepted" || data.type === "TaskReopened") restartGraph();
      const tr = document.createElement("tr");
      tr.innerHTML = `<td class="small">${fmtTime(data.ts_ms)}</td><td>${esc(data.type)}</td>
        <td class="mono small">${data.task_id ? `<a href="javascript:void 0" data-task="${esc(data.task_id)}">${esc(data.task_id)}</a>` : ""}</td>
        <td class="num">${data.attempt ?? ""}</td><td class="small">${esc(data.detail)}</td>`;
      tbody.insertBefore(tr, tbody.firstChild);
      while (tbody.rows.length > 500) tbody.deleteRow(tbody.rows.length - 1);
      $("#hist-count").textContent = `${histCount} events`;
      if (data.task_id) refreshAttempts();
    } else if (kind === "job") {
      const was = job.state;
      job = data;
      $("#job-head").innerHTML = jobHeader(job);
      bindButtons();
      if (was !== job.state) refreshAttempts();
    } else if (kind === "end") {
      loadAttempts();
    }
  };
  tbody.addEventListener("click", (e) => { const a = e.target.closest("a[data-task]"); if (a) { select(a.dataset.task); if (graph) graph.focus(a.dataset.task); } });
  const restartGraph = async () => {
    try { const g = await api(`/v1/jobs/${enc(jobId)}/graph`); if (graph && !signal.aborted) graph.load(g); } catch (e) { /* keep the old one */ }
  };
  let streamAbort = new AbortController();
  const restart = () => { streamAbort.abort(); streamAbort = new AbortController(); tbody.innerHTML = ""; histCount = 0; followJob(jobId, onEvent, streamAbort.signal); restartGraph(); };
  followJob(jobId, onEvent, streamAbort.signal);
  hooks.ready = true;
  signal.addEventListener("abort", () => {
    streamAbort.abort(); clearInterval(tick); if (attemptsTimer) clearTimeout(attemptsTimer);
    window.removeEventListener("resize", onResize);
    if (graph) graph.destroy(); if (timeline) timeline.destroy();
    hooks.graph = null; setLive(false);
  });
}

async function pageOps(signal) {
  view.innerHTML = `<h1>Operations</h1>
    <div class="grid2"><div><h2>Queues</h2><div id="ops-queues"></div></div><div><h2>Tenants</h2><div id="ops-tenants"></div></div></div>
    <h2>Stuck tasks <span class="muted small">past a lease, start-to-close, schedule-to-start or backoff deadline, or queued over 10 min</span></h2><div id="ops-stuck"></div>
    <div class="grid2"><div><h2>Failure reasons</h2><div id="ops-reasons"></div></div><div><h2>Recent failures</h2><div id="ops-recent"></div></div></div>`;
  const load = async () => {
    try {
      const [q, t, s, f] = await Promise.all([api("/v1/queues"), api("/v1/tenants"), api("/v1/stuck?queued_longer_than_s=600"), api("/v1/failures?limit=20")]);
      if (signal.aborted) return;
      $("#ops-queues").innerHTML = q.queues.length ? `<table id="queues"><thead><tr><th>queue</th><th class="num">runnable</th><th class="num">running</th><th class="num">retrying</th><th class="num">oldest wait</th></tr></thead><tbody>
        ${q.queues.map((x) => `<tr><td>${esc(x.queue)}</td><td class="num">${x.runnable}</td><td class="num">${x.running}</td><td class="num">${x.retrying}</td><td class="num">${x.oldest_runnable_age_s != null ? fmtDur(Math.round(x.oldest_runnable_age_s * 1000)) : ""}</td></tr>`).join("")}</tbody></table>`
        : `<div class="empty">No open tasks in any queue.</div>`;
      $("#ops-tenants").innerHTML = tenantsTable(t);
      $("#ops-stuck").innerHTML = s.tasks.length ? `<table id="stuck"><thead><tr><th>job</th><th>task</th><th>kind</th><th class="num">overdue</th><th>state</th><th>worker</th><th>queue</th></tr></thead><tbody>
        ${s.tasks.map((x) => `<tr><td class="mono small"><a href="#/jobs/${enc(x.job_id)}">${esc(x.job_id)}</a></td><td class="mono small">${esc(x.task_id)}</td><td>${esc(x.kind)}</td><td class="num">${fmtDur(Math.round(x.overdue_s * 1000))}</td><td>${badge(x.state)}</td><td class="mono small">${esc(x.worker_id || "")}</td><td>${esc(x.queue)}</td></tr>`).join("")}</tbody></table>`
        : `<div class="empty">Nothing stuck.</div>`;
      $("#ops-reasons").innerHTML = f.reasons.length ? `<table><thead><tr><th>reason</th><th class="num">count</th><th class="num">final</th><th>last</th></tr></thead><tbody>
        ${f.reasons.map((x) => `<tr><td title="${esc(x.sample_reason)}">${esc(x.class)}</td><td class="num">${x.count}</td><td class="num">${x.final}</td><td class="small"><a href="#/jobs/${enc(x.last_job_id)}">${esc(x.last_task_id)}</a> ${fmtTime(x.last_ms)}</td></tr>`).join("")}</tbody></table>`
        : `<div class="empty">No failures.</div>`;
      $("#ops-recent").innerHTML = f.recent.length ? `<table><thead><tr><th>time</th><th>task</th><th>reason</th></tr></thead><tbody>
        ${f.recent.map((x) => `<tr><td class="small">${fmtTime(x.ts_ms)}</td><td class="mono small"><a href="#/jobs/${enc(x.job_id)}">${esc(x.task_id)}</a> #${x.attempt}</td><td class="small">${x.final ? "" : "(retried) "}${esc(x.reason)}</td></tr>`).join("")}</tbody></table>`
        : `<div class="empty">No failures.</div>`;
      hooks.ready = true;
    } catch (e) { view.insertAdjacentHTML("afterbegin", errorBox(e)); }
  };
  await load();
  const timer = setInterval(load, 3000);
  signal.addEventListener("abort", () => clearInterval(timer));
}

function tenantsTable(t) {
  if (!t.tenants.length) return `<div class="empty">No tenant has submitted a job yet.</div>`;
  return `<table id="tenants"><thead><tr><th>tenant</th><th class="num">open jobs</th><th class="num">running tasks</th><th class="num">task share</th>${t.cluster ? `<th class="num">GPUs</th><th class="num">GPU share</th><th class="num">GPUs queued</th>` : ""}<th class="num">failures</th></tr></thead><tbody>
    ${t.tenants.map((x) => `<tr><td><i style="display:inline-block;width:10px;height:10px;border-radius:2px;background:${hueColor(x.tenant)}"></i> ${esc(x.tenant)}</td>
      <td class="num">${x.open_jobs}</td><td class="num">${x.running_tasks}</td><td class="num">${(x.share.running_tasks * 100).toFixed(1)}%</td>
      ${t.cluster ? `<td class="num">${x.gpus ?? 0}</td><td class="num">${((x.share.gpus || 0) * 100).toFixed(1)}%</td><td class="num">${x.gpus_queued ?? 0}</td>` : ""}
      <td class="num">${x.failures}</td></tr>`).join("")}</tbody></table>`;
}

class NodeMap extends PanZoom {
  constructor(canvas, nodes) {
    super(canvas);
    this.nodes = nodes;
    this.cols = Math.max(1, Math.floor((this.w - 20) / 118));
    const rows = Math.ceil(nodes.length / this.cols);
    canvas.style.height = `${Math.min(460, Math.max(120, rows * 46 + 20))}px`;  // no empty band under few nodes
    this.resize();
    this.redraw();
  }
  cell(i) { return [10 + (i % this.cols) * 118, 10 + Math.floor(i / this.cols) * 46]; }
  nodeAt(x, y) {
    const [wx, wy] = this.toWorld(x, y);
    const c = Math.floor((wx - 10) / 118), r = Math.floor((wy - 10) / 46);
    if (c < 0 || c >= this.cols || r < 0) return null;
    const i = r * this.cols + c;
    return this.nodes[i] || null;
  }
  hoverText(x, y) {
    const n = this.nodeAt(x, y);
    if (!n) return null;
    const per = Object.entries(n.tenants || {}).map(([t, g]) => `${t}: ${g}`).join(", ");
    return `${n.node_id} (${n.gpu_type || "?"}, ${n.pool || "default"})\n${n.health} · ${n.allocated}/${n.gpus} GPUs${per ? "\n" + per : ""}${n.utilization != null ? `\nutil ${(n.utilization * 100).toFixed(0)}%` : ""}`;
  }
  draw() {
    const { ctx } = this;
    ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    ctx.clearRect(0, 0, this.w, this.h);
    ctx.setTransform(this.sx * this.dpr, 0, 0, this.sy * this.dpr, this.tx * this.dpr, this.ty * this.dpr);
    this.nodes.forEach((n, i) => {
      const [x, y] = this.cell(i);
      const healthy = ["healthy", "ok", "up", "ready", "active", "available"].includes(String(n.health));
      ctx.fillStyle = healthy ? "#f3f4f6" : "#fee2e2";
      ctx.fillRect(x, y, 112, 40);
      const cells = [];
      for (const [t, g] of Object.entries(n.tenants || {})) for (let k = 0; k < g; k++) cells.push(t === "other" ? "#94a3b8" : hueColor(t));
      const gpus = Math.max(n.gpus, cells.length);
      const per = Math.min(gpus, 8) || 1, cw = 104 / per;
      for (let k = 0; k < gpus; k++) {
        const cx = x + 4 + (k % per) * cw, cy = y + 16 + Math.floor(k / per) * 10;
        ctx.fillStyle = cells[k] || (healthy ? "#d1d5db" : "#fca5a5");
        ctx.fillRect(cx, cy, cw - 2, 8);
      }
      ctx.fillStyle = "#374151"; ctx.font = "10px system-ui";
      ctx.fillText(String(n.node_id).slice(0, 18), x + 4, y + 11);
    });
  }
}

async function pageCluster(signal) {
  view.innerHTML = `<h1>GPU cluster</h1><div id="cl-body"><p class="muted">loading…</p></div><h2>Tenant shares</h2><div id="cl-tenants"></div>`;
  let map = null;
  const load = async () => {
    try {
      const [c, t] = await Promise.all([api("/v1/cluster"), api("/v1/tenants")]);
      if (signal.aborted) return;
      $("#cl-tenants").innerHTML = tenantsTable(t);
      if (!c.available) {
        $("#cl-body").innerHTML = `<div class="empty" id="cluster-empty">No GPU nodes yet: this page fills in when the GPU allocator reports node inventory and allocations (events <code>dagfold.allocator.*</code>).<br>CPU work is on the Jobs and Operations pages.</div>`;
        hooks.ready = true;
        return;
      }
      const n = await api("/v1/cluster/nodes?limit=1000");
      const tot = c.totals;
      const first = !$("#nodemap");
      if (first) {
        $("#cl-body").innerHTML = `<div class="panel"><div class="row" style="align-items:center"><div class="grow" id="cl-totals"></div></div></div>
          <h2>Nodes <span class="muted small">(first 1000; hover for details)</span></h2>
          <div class="nodes-legend" id="cl-legend"></div>
          <div class="canvas-wrap"><canvas id="nodemap" style="height:460px"></canvas><div class="canvas-tools"><button id="nm-reset">reset</button></div></div>
          <h2>Pools</h2><div id="cl-pools"></div>`;
      }
      $("#cl-totals").innerHTML = `<b>${tot.allocated}</b> of <b>${tot.healthy_gpus}</b> healthy GPUs allocated (${(tot.allocation_ratio * 100).toFixed(1)}%) · ${tot.gpus} GPUs on ${tot.nodes} nodes · ${tot.free} free · ${tot.gpus - tot.healthy_gpus} unhealthy · ${tot.queued || 0} requests queued (${tot.queued_gpus || 0} GPUs)
        <div style="margin-top:6px">${bar(tot.allocation_ratio * 100)}</div>`;
      $("#cl-legend").innerHTML = c.tenants.map((x) => `<span><i style="background:${hueColor(x.tenant)}"></i>${esc(x.tenant)} ${x.gpus}</span>`).join("") + `<span><i style="background:#d1d5db"></i>free</span><span><i style="background:#fca5a5"></i>unhealthy</span>`;
      $("#cl-pools").innerHTML = `<table><thead><tr><th>pool</th><th class="num">nodes</th><th class="num">GPUs</th><th class="num">allocated</th><th class="num">unhealthy nodes</th></tr></thead><tbody>${c.pools.map((p) => `<tr><td>${esc(p.pool)}</td><td class="num">${p.nodes}</td><td class="num">${p.gpus}</td><td class="num">${p.allocated}</td><td class="num">${p.unhealthy_nodes}</td></tr>`).join("")}</tbody></table>`;
      if (first) {
        map = new NodeMap($("#nodemap"), n.nodes);
        $("#nm-reset").addEventListener("click", () => { map.sx = map.sy = 1; map.tx = map.ty = 0; map.redraw(); });
      } else if (map) { map.nodes = n.nodes; map.redraw(); }
      hooks.ready = true;
    } catch (e) { $("#cl-body").innerHTML = errorBox(e); }
  };
  await load();
  const timer = setInterval(load, 3000);
  signal.addEventListener("abort", () => { clearInterval(timer); if (map) map.destroy(); });
}

// -- router ----------------------------------------------------------------------------------
let current = null;
function route() {
  if (current) current.abort();
  current = new AbortController();
  hooks.ready = false;
  tooltip.hidden = true;
  const hash = location.hash.replace(/^#/, "") || "/jobs";
  const [path, query] = hash.split("?");
  const params = new URLSearchParams(query || "");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const name = parts[0] || "jobs";
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.toggle("active", a.dataset.nav === name);
  hooks.page = name === "jobs" && parts[1] ? "job" : name;
  if (name === "jobs" && parts[1]) pageJob(parts.slice(1).join("/"), current.signal, params);
  else if (name === "ops") pageOps(current.signal);
  else if (name === "cluster") pageCluster(current.signal);
  else if (name === "deadletters") pageDeadLetters(current.signal);  // static/deadletters.js
  else pageJobs(params, current.signal);
}
hooks.isMarkedRun = (id) => (hooks.graph ? hooks.graph.markedRun.has(hooks.graph.index.get(id)) : null);
hooks.stateOf = (id) => (hooks.graph ? hooks.graph.states[hooks.graph.index.get(id)] ?? null : null);
hooks.nodeScreenPos = (id) => (hooks.graph ? hooks.graph.screenPos(id) : null);
hooks.focus = (id) => { if (hooks.graph) hooks.graph.focus(id); };
window.addEventListener("hashchange", route);
route();

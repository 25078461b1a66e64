/* dagfold dashboard: the dead-letters page (#/deadletters), loaded before app.js and using its helpers
 * (api, esc, enc, fmtTime, errorBox, view, hooks) at call time.
 *
 * Dead letters are hostile records: every field goes through esc() (the API already bounds them), the
 * preview is shown as text in a <pre>, and nothing from a record becomes markup, a URL or an attribute
 * other than an escaped title. Resubmitting asks the API, which decodes and validates the record again.
 */
"use strict";

async function pageDeadLetters(signal) {
  view.innerHTML = `<h1>Dead letters <span class="muted small">records a service could not take: where from, who, why</span></h1>
    <div id="dl-msg"></div><div id="dl-list"></div><p><button id="dl-more" class="link" type="button" hidden>older…</button></p>`;
  let cursor = null;
  const rows = [];
  const render = () => {
    $("#dl-list").innerHTML = rows.length ? `<table id="deadletters"><thead><tr><th>id</th><th>time</th><th>source</th><th>service</th><th>record</th><th>reason</th><th>preview</th><th></th></tr></thead><tbody>
      ${rows.map((d) => `<tr>
        <td class="mono small">${esc(d.id)}</td><td class="small">${fmtTime(d.ts_ms)}</td>
        <td class="mono small">${esc(d.source_topic)}/${esc(d.source_partition)}@${esc(d.source_offset)}</td>
        <td>${esc(d.service)}</td>
        <td class="small">${esc((d.record_type || "undecodable").split(".").pop())}${d.job_id ? `<div class="mono">${d.job_state ? `<a href="#/jobs/${enc(d.job_id)}">${esc(d.job_id)}</a> ${esc(d.job_state)}` : esc(d.job_id)}</div>` : ""}</td>
        <td class="small">${esc(d.reason)}</td>
        <td><details><summary class="small">${esc(d.value_bytes)} bytes</summary><pre class="small dl-preview">${esc(d.preview)}</pre></details></td>
        <td>${d.resubmittable && !d.job_state ? `<button type="button" data-resubmit="${esc(d.id)}">resubmit</button>` : ""}</td></tr>`).join("")}</tbody></table>`
      : `<div class="empty">No dead letters.</div>`;
    $("#dl-more").hidden = !cursor;
  };
  const load = async (more) => {
    try {
      const q = new URLSearchParams({ limit: "100" });
      if (more && cursor) q.set("cursor", cursor);
      const page = await api(`/v1/deadletters?${q}`);
      if (signal.aborted) return;
      if (!more) rows.length = 0;
      rows.push(...page.deadletters);
      cursor = page.next_cursor;
      render();
      hooks.ready = true;
    } catch (e) { $("#dl-msg").innerHTML = errorBox(e); }
  };
  $("#dl-more").addEventListener("click", () => load(true));
  $("#dl-list").addEventListener("click", async (ev) => {
    const id = ev.target && ev.target.dataset ? ev.target.dataset.resubmit : null;
    if (!id) return;
    ev.target.disabled = true;
    try {
      const res = await api(`/v1/deadletters/${enc(id)}/resubmit`, { method: "POST" });
      $("#dl-msg").innerHTML = `<div class="empty small">resubmitted ${esc(id)}: job <a href="#/jobs/${enc(res.job_id)}">${esc(res.job_id)}</a> ${esc(res.state)}</div>`;
      await load(false);
    } catch (e) { $("#dl-msg").innerHTML = errorBox(e); ev.target.disabled = false; }
  });
  await load(false);
}

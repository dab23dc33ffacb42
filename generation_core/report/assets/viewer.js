// genrun trajectory viewer: reads the JSON in #viewer-data (report_viewer.viewer_payload),
// lists the trajectories that pass the filters, and shows one turn by turn, each response
// token shaded by response_mask (model vs tool/user) and, for model tokens, by its logprob.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("viewer-data").textContent);
  const all = data.trajectories;
  const $ = (id) => document.getElementById(id);
  const list = $("traj-list"), detail = $("traj-detail"), count = $("shown-count");
  const filters = {
    rewardMin: $("f-reward-min"), rewardMax: $("f-reward-max"), source: $("f-source"),
    lengthMin: $("f-length-min"), lengthMax: $("f-length-max"), stop: $("f-stop"),
    replica: $("f-replica"), sort: $("f-sort"), slowest: $("f-slowest"),
  };
  const TIMES = [["slot_wait", "slot wait"], ["prefill", "prefill"], ["decode", "decode"], ["tools", "tool calls"], ["reward", "reward fn"], ["total", "total"]];
  let selected = null;

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function addOptions(select, values, label) {
    for (const value of values) {
      const option = el("option", "", label ? label(value) : value);
      option.value = value;
      select.appendChild(option);
    }
  }
  addOptions(filters.source, [...new Set(all.map((t) => t.source))].sort());
  addOptions(filters.replica, [...new Set(all.flatMap((t) => t.replicas || []))].sort());
  addOptions(filters.stop, Object.keys(data.stop_reasons).filter((s) => all.some((t) => t.stop === s)), (s) => data.stop_reasons[s]);

  function number(input) {
    const value = input.value.trim();
    return value === "" ? null : Number(value);
  }
  function passes(t) {
    const rMin = number(filters.rewardMin), rMax = number(filters.rewardMax);
    if ((rMin !== null || rMax !== null) && t.reward === null) return false;
    if (rMin !== null && t.reward < rMin) return false;
    if (rMax !== null && t.reward > rMax) return false;
    const lMin = number(filters.lengthMin), lMax = number(filters.lengthMax);
    if (lMin !== null && t.length < lMin) return false;
    if (lMax !== null && t.length > lMax) return false;
    if (filters.source.value && t.source !== filters.source.value) return false;
    if (filters.stop.value && t.stop !== filters.stop.value) return false;
    if (filters.replica.value && !(t.replicas || []).includes(filters.replica.value)) return false;
    return true;
  }
  // A timing of a trajectory (seconds), null where unknown (an engine that does not report it,
  // a trajectory of a genrun that did not keep timings).
  function timing(t, name) { return t.time && t.time[name] !== null && t.time[name] !== undefined ? t.time[name] : null; }
  // The sort timing, or the total when sorting by sample id: "slowest 1%" keeps the sampled
  // trajectories at or above its 99th percentile (at least one).
  function slowestCut(name) {
    const values = all.map((t) => timing(t, name)).filter((v) => v !== null).sort((a, b) => a - b);
    if (!values.length) return null;
    return values[Math.min(values.length - 1, Math.floor(0.99 * values.length))];
  }
  function fmtSeconds(s) { return s === null ? "–" : (s >= 10 ? s.toFixed(1) : s.toFixed(3)) + " s"; }
  function fmtReward(r) { return r === null ? "–" : String(Math.round(r * 1000) / 1000); }

  function renderList() {
    let shown = all.filter(passes);
    const key = filters.sort.value || "total";
    if (filters.slowest.checked) {
      const cut = slowestCut(key);
      shown = shown.filter((t) => cut !== null && timing(t, key) !== null && timing(t, key) >= cut);
    }
    if (filters.sort.value) {
      // Slowest first; unknown timings last.
      shown = shown.slice().sort((a, b) => (timing(b, key) ?? -Infinity) - (timing(a, key) ?? -Infinity));
    }
    list.replaceChildren();
    for (const t of shown) {
      const row = el("div", "traj-row");
      row.dataset.id = t.id;
      row.title = `sample ${t.id} · ${t.source} · reward ${fmtReward(t.reward)} · ${t.length} tokens · ${t.turns} turns · ${data.stop_reasons[t.stop]}`;
      row.append(el("span", "mono", t.id), el("span", "src", t.source), el("span", "mono", "r " + fmtReward(t.reward)), el("span", "mono", t.length + " tok"));
      if (filters.sort.value) row.append(el("span", "mono", fmtSeconds(timing(t, key))));
      row.addEventListener("click", () => select(t));
      list.appendChild(row);
    }
    count.textContent = `${shown.length} of ${all.length} shown`;
    if (!shown.includes(selected)) select(shown.length ? shown[0] : null);
    else markSelected();
  }
  function markSelected() {
    for (const row of list.children) row.classList.toggle("selected", selected !== null && row.dataset.id === selected.id);
  }

  function tokenColor(logprob) {
    const p = Math.exp(logprob);
    return `hsl(${Math.round(120 * p)}, 75%, 80%)`;
  }
  function renderTokens(t, start, length, model, into) {
    for (let i = start; i < start + length; i++) {
      const id = t.ids[i];
      const fixed = t.fix[String(i)];
      const text = fixed !== undefined ? fixed : (data.pieces[String(id)] ?? `⟨${id}⟩`);
      const span = el("span", model ? "tok model" : "tok tool", text);
      let hover = `#${i} token ${id} ${JSON.stringify(text)}`;
      if (model && t.logprobs) {
        const lp = t.logprobs[i];
        span.style.background = tokenColor(lp);
        span.dataset.logprob = lp;
        hover += ` · logprob ${lp.toFixed(3)} · p ${Math.exp(lp).toFixed(3)}`;
      } else if (!model) {
        hover += " · tool/user token (response_mask 0)";
      }
      span.title = hover;
      into.appendChild(span);
    }
  }
  function select(t) {
    selected = t;
    markSelected();
    detail.replaceChildren();
    if (t === null) { detail.appendChild(el("p", "note", "No trajectory passes the filters.")); return; }
    const head = el("div", "detail-head");
    const facts = [["sample", t.id], ["data source", t.source], ["reward", fmtReward(t.reward)], ["response", `${t.length} tokens (${t.model_tokens} model)`],
      ["turns", t.turns], ["stopped", data.stop_reasons[t.stop]]];
    for (const [k, v] of facts) { const s = el("span"); s.append(k + ": ", el("b", "", String(v))); head.appendChild(s); }
    detail.appendChild(head);
    if (t.time) {
      const split = el("div", "detail-head time-split");
      for (const [name, label] of TIMES) { const s = el("span"); s.append(label + ": ", el("b", "", fmtSeconds(timing(t, name)))); split.appendChild(s); }
      const s = el("span"); s.append("replica(s): ", el("b", "", (t.replicas || []).join(", ") || "–")); split.appendChild(s);
      detail.appendChild(split);
    }
    const legend = el("div", "legend");
    if (t.logprobs) legend.append("model token logprob:", el("span", "", "p=0"), el("span", "bar"), el("span", "", "p=1"));
    else { const sw = el("span", "swatch"); sw.style.background = "#dbeafe"; legend.append(sw, "model token (no logprobs in this run)"); }
    const tool = el("span", "swatch"); tool.style.background = "#e2e8f0";
    legend.append(tool, "tool/user token (response_mask 0) · hover a token for its id and logprob");
    detail.appendChild(legend);
    const prompt = el("div", "turn prompt");
    prompt.append(el("div", "turn-head", "prompt (as sent to the engine)"));
    if ((t.images || []).length || t.images_hidden) {
      const pictures = el("div", "images");
      for (const digest of t.images || []) { const img = el("img"); img.src = data.images[digest]; img.alt = "prompt image"; pictures.appendChild(img); }
      if (t.images_hidden) pictures.append(` ${t.images_hidden} image(s) not shown (the page keeps ${data.image_limit})`);
      prompt.appendChild(pictures);
    }
    prompt.appendChild(el("pre", "", t.prompt));
    detail.appendChild(prompt);
    let position = 0, modelTurn = 0;
    for (const [mask, length] of t.runs) {
      const model = mask === 1;
      const turn = el("div", model ? "turn model" : "turn tool");
      let label = model ? `model turn ${++modelTurn} · ${length} tokens` : `tool / user tokens · ${length}`;
      const served = model && t.turn_info ? t.turn_info[modelTurn - 1] : undefined;
      if (served) label += ` · replica ${served[0] ?? "–"} · ${served[2].toFixed(3)} s · stop ${served[1] ?? "–"}`;
      if (model && t.logprobs) {
        const lps = t.logprobs.slice(position, position + length);
        label += ` · mean logprob ${(lps.reduce((a, b) => a + b, 0) / Math.max(lps.length, 1)).toFixed(3)}`;
      }
      const tokens = el("div", "tokens");
      renderTokens(t, position, length, model, tokens);
      turn.append(el("div", "turn-head", label), tokens);
      detail.appendChild(turn);
      position += length;
    }
  }
  for (const input of Object.values(filters)) input.addEventListener("input", renderList);
  renderList();
})();

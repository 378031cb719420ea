// The playground: POST /v1/dllm/trace, parse its server-sent events, replay them step by step.
// No dependencies; everything is served by the package (docs/playground.md).
"use strict";

const $ = (id) => document.getElementById(id);
const NUMBER_FIELDS = ["max_tokens", "temperature", "seed"];
const DIFFUSION_NUMBER_FIELDS = ["num_denoising_steps", "block_length", "confidence_threshold",
                                 "entropy_bound", "edit_threshold"];
// What a test (or a curious user in the console) can read about the last run.
const FRESH = () => ({ status: "idle", steps: 0, maxMasked: 0, finalMasked: null,
                      maskedAfterFirstStep: null, rounds: 0, roundEvents: 0, content: "",
                      events: [], blocks: 0, neverNeeded: 0, edits: 0 });
const run = (window.playground = FRESH());
// "diffusion" or "self_speculation" once /v1/dllm/info answered; null before (or when it
// failed, e.g. a server with --api-key before the key is typed): no mode-specific settings
// are shown or sent until the page knows which apply.
let mode = null;
let infoLoading = null;
let triMode = false; // a tri-mode model: the page sends the decoding_mode picked in its menu
// Block-diffusion models number blocks from position 0 of the whole sequence (the prompt's
// whole blocks included, so the answer's first block may be partial); canvas and tri-mode
// models from the answer's first position.
let absoluteBlocks = false;
// DiffusionGemma: uniform-state canvases re-drawn every step; only num_denoising_steps and
// entropy_bound of the denoising settings apply (the API refuses the mask-based ones).
let renoise = false;
let stopping = null; // the running generation's AbortController (the Stop button)

async function loadInfo() {
  try {
    const res = await fetch("/v1/dllm/info", { headers: authHeaders() });
    if (!res.ok) {
      const hint = res.status === 401 ? " (this server needs an API key: see Page → API key)" : "";
      $("model-info").textContent = `model info: HTTP ${res.status}${hint}`;
      return;
    }
    const info = await res.json();
    let shown = info.decoding_mode.replace("_", " ");
    mode = info.decoding_mode === "self_speculation" ? "self_speculation" : "diffusion";
    // A tri-mode model decodes each request by the mode picked in the menu (its default
    // first); only diffusion has a canvas and denoising settings.
    triMode = info.decoding_mode === "tri_mode";
    absoluteBlocks = info.decoding_mode === "block_diffusion";
    renoise = info.decoding_mode === "renoise";
    for (const label of document.querySelectorAll("[data-not-renoise]")) label.hidden = renoise;
    $("decoding-mode-setting").hidden = !triMode;
    if (triMode) {
      shown = `tri-mode (${info.default_decoding_mode.replace("_", " ")})`;
      if (!$("decoding_mode").dataset.picked) $("decoding_mode").value = info.default_decoding_mode;
      mode = triModeView();
    }
    $("model-info").textContent =
      `${info.model} · ${shown} · default max_tokens ${info.default_max_tokens}`;
    // Token editing only where the model was trained for it (LLaDA2.x).
    $("edit-setting").hidden = !(info.commit_rules || []).includes("joint_threshold");
    showModeSettings();
  } catch (err) { $("model-info").textContent = `model info: ${err}`; }
}

const triModeView = () => ($("decoding_mode").value === "diffusion" ? "diffusion" : "self_speculation");

function showModeSettings() {
  // Self-speculative decoding has no canvas settings (the API rejects them with a 400).
  $("diffusion-settings").hidden = mode !== "diffusion";
  $("masked-stat").hidden = mode !== "diffusion";
}

// The view a run draws (from its start event): the canvas and its legend, or the rounds.
function showView(view) {
  $("masked-stat").hidden = view !== "diffusion";
  $("canvas-legend").hidden = view !== "diffusion";
  $("renoise-legend").hidden = view !== "renoise";
  $("rounds-legend").hidden = view !== "self_speculation";
  $("chart-box").hidden = view === null;
}

function reloadInfo() {
  infoLoading = loadInfo();
  return infoLoading;
}

function authHeaders() {
  const key = $("api_key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function requestBody() {
  const body = { messages: [{ role: "user", content: $("prompt").value || $("prompt").placeholder }] };
  const fields = mode === "diffusion" ? [...NUMBER_FIELDS, ...DIFFUSION_NUMBER_FIELDS] : NUMBER_FIELDS;
  for (const name of fields) {
    if ($(name).closest("label").hidden) continue; // does not apply to this model
    const value = $(name).value.trim();
    if (value !== "") body[name] = Number(value);
  }
  if (mode === "diffusion" && !renoise) {
    if ($("block_schedule").value) body.block_schedule = $("block_schedule").value;
    if ($("use_local_leap").checked) body.use_local_leap = true;
  }
  if (triMode) body.decoding_mode = $("decoding_mode").value;
  return body;
}

// Server-sent events from a fetch body: "event: name\r\ndata: json\r\n\r\n" records.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const record = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let name = "message", data = "";
      for (const line of record.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data += line.slice(5).trim();
      }
      if (data) yield { name, data: JSON.parse(data) };
    }
  }
}

// The replay's pause between steps; Stop ends it at once.
const sleep = (ms, signal) => new Promise((resolve) => {
  const timer = setTimeout(resolve, ms);
  signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
});

function label(text) {
  // Specials (EOS, end of turn) and whitespace made visible.
  if (/^<\|.*\|>$/.test(text) || /^<.*>$/.test(text)) return ["EOS", true];
  return [text.replace(/ /g, "␣").replace(/\n/g, "⏎") || "∅", false];
}

// A committed cell's shade: amber (unsure) to light green (sure), dark text on every shade.
// The scale counts nines (0.9, 0.99, 0.999, 0.9999 are evenly spaced): a trained model commits
// most tokens above 0.99, and a linear scale would paint them all alike.
const NINES = 4;
function confidenceColor(confidence) {
  const t = Math.min(1, -Math.log10(Math.max(1 - confidence, 10 ** -NINES)) / NINES);
  return `hsl(${Math.round(30 + 105 * t)} ${Math.round(90 - 35 * t)}% ${Math.round(62 + 23 * t)}%)`;
}

let cells = []; // the canvas's cells, by answer position
let blockFrames = []; // one frame per block
let firstBlock = 0; // the block number (as the step events count) of the answer's first block

function drawCanvas(start) {
  const size = start.canvas;
  const width = start.block_length || size;
  const prompt = absoluteBlocks ? start.prompt_tokens || 0 : 0;
  firstBlock = Math.floor(prompt / width);
  const blockOf = (i) => Math.floor((prompt + i) / width) - firstBlock;
  cells = [];
  blockFrames = [];
  for (let i = 0; i < size; i++) {
    if (blockOf(i) === blockFrames.length) {
      const frame = document.createElement("div");
      frame.className = "block";
      blockFrames.push(frame);
    }
    const cell = document.createElement("span");
    cell.className = "cell masked";
    cell.textContent = "▒";
    cell.title = `position ${i}: masked`;
    blockFrames[blockFrames.length - 1].append(cell);
    cells.push(cell);
  }
  for (const frame of blockFrames) {
    frame.title = `block ${blockFrames.indexOf(frame) + 1} of ${blockFrames.length}`;
    if (blockFrames.length === 1) frame.classList.add("single");
  }
  $("canvas").replaceChildren(...blockFrames);
  run.blocks = blockFrames.length;
}

// A renoise canvas: one frame of cells showing the canvas's current argmax, which every step
// may change anywhere (nothing is locked until the canvas is done).
let renoiseCanvas = -1;
function drawRenoise(start) {
  const frame = document.createElement("div");
  frame.className = "block single";
  cells = [];
  for (let i = 0; i < start.canvas; i++) {
    const cell = document.createElement("span");
    cell.className = "cell masked";
    cell.textContent = "·";
    cell.title = `position ${i}: random noise`;
    frame.append(cell);
    cells.push(cell);
  }
  blockFrames = [frame];
  renoiseCanvas = -1;
  $("canvas").replaceChildren(frame);
}

function applyRenoise(event) {
  run.steps += 1;
  if (!event.tokens.length) return; // a prefill or commit forward: no canvas to show
  if (event.canvas_index !== renoiseCanvas) {
    renoiseCanvas = event.canvas_index;
    blockFrames[0].title = `canvas ${renoiseCanvas + 1}`;
  }
  const changed = new Set(event.changed);
  event.tokens.forEach((text, i) => {
    const cell = cells[i];
    if (!cell) return;
    const [shown, special] = label(text);
    cell.textContent = shown;
    cell.className = "cell" + (changed.has(i) ? " new" : "") + (special ? " eos" : "");
    cell.title = `${JSON.stringify(text)} · canvas ${renoiseCanvas + 1}, step ${event.step}`;
  });
  addBar([[event.changed.length, ""]], `canvas ${renoiseCanvas + 1}, step ${event.step}: ` +
         `${event.changed.length} argmax token(s) changed`);
}

function markActiveBlock(block) {
  const active = block === null ? -1 : block - firstBlock;
  blockFrames.forEach((frame, i) => frame.classList.toggle("active", i === active));
}

function applyStep(event) {
  for (const old of document.querySelectorAll("#canvas .cell.new")) old.classList.remove("new");
  const confidences = event.confidences || [];
  const replaced = event.replaced || [];
  event.commits.forEach(([pos, , text], i) => {
    const cell = cells[pos];
    if (!cell) return;
    const [shown, special] = label(text);
    const confidence = confidences[i];
    cell.textContent = shown;
    cell.className = "cell new" + (special ? " eos" : "");
    if (typeof confidence === "number") {
      cell.style.background = confidenceColor(confidence);
      cell.dataset.confidence = String(confidence);
      cell.title = `${JSON.stringify(text)} · confidence ${confidence} · step ${event.step}`;
    } else if (confidence === null) { // a seed: placed, not chosen by a confidence rule
      cell.classList.add("seed");
      cell.title = `${JSON.stringify(text)} · seed (no confidence) · step ${event.step}`;
    } else {
      cell.title = `${JSON.stringify(text)} · step ${event.step}`;
    }
    if (typeof replaced[i] === "string") { // token editing rewrote a written token
      cell.classList.add("edited");
      cell.title += ` · edited (was ${JSON.stringify(replaced[i])})`;
      run.edits += 1;
    }
  });
  run.steps += 1;
  run.finalMasked = event.masked;
  if (run.steps === 1) run.maskedAfterFirstStep = document.querySelectorAll("#canvas .cell.masked").length;
  $("stat-masked").textContent = event.masked;
  markActiveBlock(event.masked ? event.block : null);
  addBar([[event.commits.length, ""]],
         `step ${event.step}: ${event.commits.length} token(s) committed`);
}

function applyRound(event) {
  const own = event.emitted.length - event.accepted;
  addBar([[event.accepted, "accepted"], [Math.max(0, own), "own"]],
         `forward ${event.round}: ${event.accepted} of ${event.drafts.length} draft(s) accepted, ` +
         `${event.emitted.length} token(s) emitted`);
  run.roundEvents += 1;
  // A forward that verified nothing and emitted nothing (LinearSpec's first, drafting-only
  // forward; the forward that verifies the stop token) has no line: only the counters move.
  if (!event.drafts.length && !event.emitted.length) return;
  const item = document.createElement("li");
  event.drafts.forEach((text, i) => {
    const span = document.createElement("span");
    span.className = "tok " + (i < event.accepted ? "accepted" : "rejected");
    span.textContent = label(text)[0];
    item.append(span);
  });
  const arrow = document.createElement("span");
  arrow.textContent = event.drafts.length ? " → " : "";
  item.append(arrow);
  for (const text of event.emitted) {
    const span = document.createElement("span");
    span.className = "tok emitted";
    span.textContent = label(text)[0];
    item.append(span);
  }
  $("rounds").append(item);
  run.rounds += 1;
}

// The chart: one bar per forward, stacked parts [[height, class], ...]. Bar i spans x = i..i+1
// in the SVG's own units; the view box grows with the bars and the tallest one, so adding a bar
// never redraws the others.
const SVG = $("chart").namespaceURI; // the SVG namespace, as the parser gave the chart
let chartBars = 0;
let chartMax = 1;

function resetChart(caption) {
  chartBars = 0;
  chartMax = 1;
  $("chart-bars").replaceChildren();
  $("chart-caption").replaceChildren(...caption);
  scaleChart();
}

function scaleChart() {
  $("chart").setAttribute("viewBox", `0 0 ${Math.max(chartBars, 1)} ${chartMax}`);
  // Bars grow up from the bottom edge.
  $("chart-bars").setAttribute("transform", `matrix(1 0 0 -1 0 ${chartMax})`);
  const caption = $("chart-caption");
  if (caption.lastElementChild) caption.lastElementChild.textContent = `tallest bar: ${chartMax}`;
}

function addBar(parts, title) {
  const bar = document.createElementNS(SVG, "g");
  bar.setAttribute("class", "bar");
  let base = 0;
  for (const [height, kind] of parts) {
    const rect = document.createElementNS(SVG, "rect");
    rect.setAttribute("x", chartBars + 0.12);
    rect.setAttribute("y", base);
    rect.setAttribute("width", 0.76);
    rect.setAttribute("height", height);
    if (kind) rect.setAttribute("class", kind);
    bar.append(rect);
    base += height;
  }
  const tip = document.createElementNS(SVG, "title");
  tip.textContent = title;
  bar.append(tip);
  $("chart-bars").append(bar);
  chartBars += 1;
  chartMax = Math.max(chartMax, base);
  scaleChart();
}

function chartCaption(text) {
  const what = document.createElement("span");
  what.textContent = text;
  const tallest = document.createElement("span");
  return [what, tallest];
}

function showCounters(event) {
  $("stat-step").textContent = event.step ?? event.round;
  $("stat-nfe").textContent = event.nfe;
  $("stat-tpf").textContent = event.tokens_per_forward.toFixed(2);
}

// An answer that ended early leaves the blocks after it never decoded: drawn as empty
// outlines, and said in words (a bare "masked 992" on a finished answer reads as a failure).
function finishCanvas() {
  markActiveBlock(null);
  const unused = document.querySelectorAll("#canvas .cell.masked");
  for (const cell of unused) {
    cell.className = "cell unused";
    cell.title = "never needed: the answer ended before this block";
  }
  for (const frame of blockFrames) {
    if (!frame.querySelector(".cell:not(.unused)")) frame.classList.add("unused");
  }
  run.neverNeeded = unused.length;
  if (!unused.length) return;
  $("masked-stat").hidden = true;
  $("early-note").hidden = false;
  $("early-note").textContent =
    `finished early: ${unused.length} position${unused.length === 1 ? "" : "s"} after the ` +
    `answer ${unused.length === 1 ? "was" : "were"} never needed`;
}

async function generate(submitEvent) {
  submitEvent.preventDefault();
  Object.assign(run, FRESH(), { status: "running" });
  stopping = new AbortController();
  const signal = stopping.signal;
  $("generate").disabled = true;
  $("stop").disabled = false;
  $("status").textContent = "running";
  for (const id of ["stat-step", "stat-nfe"]) $(id).textContent = "0";
  for (const id of ["stat-tpf", "stat-masked"]) $(id).textContent = "–";
  // On a narrow screen the settings sit above the output: bring the output into view.
  if (window.matchMedia("(max-width: 760px)").matches) $("view").scrollIntoView();
  $("answer").textContent = "";
  $("error").hidden = true;
  $("rounds").replaceChildren();
  $("canvas").replaceChildren();
  $("early-note").hidden = true;
  cells = [];
  blockFrames = [];
  showView(null);
  const delay = Math.max(0, Number($("replay_ms").value) || 0);
  try {
    // The settings sent depend on the model: wait for its info (the key may just have changed).
    await (mode === null ? reloadInfo() : infoLoading);
    const response = await fetch("/v1/dllm/trace", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(requestBody()),
      signal, // Stop closes the connection, which aborts the request on the server
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error(body.error?.message || `HTTP ${response.status}`);
    }
    for await (const { name, data } of sseEvents(response)) {
      run.events.push(name);
      if (name === "start") {
        if (data.mode === "renoise") {
          drawRenoise(data);
          resetChart(chartCaption("argmax tokens that changed, per step"));
        } else if (data.mode === "diffusion") {
          drawCanvas(data);
          run.maxMasked = data.canvas;
          $("stat-masked").textContent = data.canvas;
          resetChart(chartCaption("tokens committed per step"));
        } else {
          resetChart(chartCaption("accepted drafts (green) and the verifier's own tokens " +
                                  "(yellow) per forward"));
        }
        showView(data.mode);
      } else if (name === "step") {
        applyStep(data); showCounters(data); await sleep(delay, signal);
      } else if (name === "renoise") {
        applyRenoise(data); showCounters(data); await sleep(delay, signal);
      } else if (name === "round") {
        applyRound(data); showCounters(data); await sleep(delay, signal);
      } else if (name === "delta") {
        $("answer").textContent += data.content;
      } else if (name === "done") {
        $("answer").textContent = data.content;
        run.content = data.content;
        $("status").textContent = `done · finish_reason ${data.finish_reason} · ` +
          `${data.usage.completion_tokens} tokens`;
        run.status = "done";
        finishCanvas();
      } else if (name === "error") {
        throw new Error(data.error.message);
      }
      if (signal.aborted) break;
    }
    if (signal.aborted) {
      run.status = "stopped";
      $("status").textContent = "stopped";
    } else if (run.status !== "done") throw new Error("the stream ended without an answer");
  } catch (err) {
    if (signal.aborted) {
      run.status = "stopped";
      $("status").textContent = "stopped";
      return;
    }
    run.status = "error";
    $("status").textContent = "error";
    $("error").hidden = false;
    $("error").textContent = String(err.message || err);
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
    for (const old of document.querySelectorAll("#canvas .cell.new")) old.classList.remove("new");
  }
}

$("prompt-form").addEventListener("submit", generate);
$("stop").addEventListener("click", () => stopping?.abort());
$("decoding_mode").addEventListener("change", () => {
  $("decoding_mode").dataset.picked = "1";
  mode = triModeView();
  showModeSettings();
});
$("api_key").addEventListener("change", reloadInfo);
// Enter in the prompt sends it, as in chat apps; Shift+Enter starts a new line.
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    if (!$("generate").disabled) $("prompt-form").requestSubmit();
  }
});
// The legend's scale is drawn with the cells' own colour function.
$("confidence-scale").style.background =
  `linear-gradient(to right, ${[0, 0.9, 0.99, 0.999, 0.9999].map(confidenceColor).join(", ")})`;
reloadInfo();

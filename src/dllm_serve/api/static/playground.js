// The playground: POST /v1/dllm/trace, parse its server-sent events, replay them step by step.
// No dependencies; everything is served by the package (docs/playground.md).
"use strict";

const $ = (id) => document.getElementById(id);
const NUMBER_FIELDS = ["max_tokens", "temperature", "seed"];
const DIFFUSION_NUMBER_FIELDS = ["num_denoising_steps", "block_length", "confidence_threshold"];
// What a test (or a curious user in the console) can read about the last run.
const run = (window.playground = { status: "idle", steps: 0, maxMasked: 0, finalMasked: null,
                                   maskedAfterFirstStep: null, rounds: 0, content: "", events: [] });
// "diffusion" or "self_speculation" once /v1/dllm/info answered; null before (or when it
// failed, e.g. a server with --api-key before the key is typed): no mode-specific settings
// are shown or sent until the page knows which apply.
let mode = null;
let infoLoading = null;
let triMode = false; // a tri-mode model: the page sends the decoding_mode picked in its menu
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
    $("decoding-mode-setting").hidden = !triMode;
    if (triMode) {
      shown = `tri-mode (${info.default_decoding_mode.replace("_", " ")})`;
      if (!$("decoding_mode").dataset.picked) $("decoding_mode").value = info.default_decoding_mode;
      mode = triModeView();
    }
    $("model-info").textContent =
      `${info.model} · ${shown} · default max_tokens ${info.default_max_tokens}`;
    showModeSettings();
  } catch (err) { $("model-info").textContent = `model info: ${err}`; }
}

const triModeView = () => ($("decoding_mode").value === "diffusion" ? "diffusion" : "self_speculation");

function showModeSettings() {
  // Self-speculative decoding has no canvas settings (the API rejects them with a 400).
  $("diffusion-settings").hidden = mode !== "diffusion";
  $("masked-stat").hidden = mode !== "diffusion";
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
    const value = $(name).value.trim();
    if (value !== "") body[name] = Number(value);
  }
  if (mode === "diffusion") {
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

function drawCanvas(size) {
  const canvas = $("canvas");
  canvas.replaceChildren();
  for (let i = 0; i < size; i++) {
    const cell = document.createElement("span");
    cell.className = "cell masked";
    cell.textContent = "▒";
    canvas.append(cell);
  }
}

function applyStep(event) {
  const cells = $("canvas").children;
  for (const old of document.querySelectorAll(".cell.new")) old.classList.remove("new");
  for (const [pos, , text] of event.commits) {
    const cell = cells[pos];
    if (!cell) continue;
    const [shown, special] = label(text);
    cell.textContent = shown;
    cell.className = "cell new" + (special ? " eos" : "");
  }
  run.steps += 1;
  run.finalMasked = event.masked;
  if (run.steps === 1) run.maskedAfterFirstStep = document.querySelectorAll(".cell.masked").length;
  $("stat-masked").textContent = event.masked;
}

function applyRound(event) {
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

function showCounters(event) {
  $("stat-step").textContent = event.step ?? event.round;
  $("stat-nfe").textContent = event.nfe;
  $("stat-tpf").textContent = event.tokens_per_forward.toFixed(2);
}

async function generate(submitEvent) {
  submitEvent.preventDefault();
  Object.assign(run, { status: "running", steps: 0, maxMasked: 0, finalMasked: null,
                       maskedAfterFirstStep: null, rounds: 0, content: "", events: [] });
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
        if (data.mode === "diffusion") {
          drawCanvas(data.canvas);
          run.maxMasked = data.canvas;
          $("stat-masked").textContent = data.canvas;
        }
      } else if (name === "step") {
        applyStep(data); showCounters(data); await sleep(delay, signal);
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
        // An answer that ended early leaves blocks never decoded: drawn as empty outlines.
        for (const cell of document.querySelectorAll(".cell.masked")) {
          cell.className = "cell unused";
          cell.title = "not decoded: the answer ended before this block";
        }
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
    for (const old of document.querySelectorAll(".cell.new")) old.classList.remove("new");
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
reloadInfo();

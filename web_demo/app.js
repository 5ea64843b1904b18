// The page: wires the audio sources, the protocol client and the caption view together.

import { SourceError, decodeFile, openMicrophone, playPcm } from "./audio-sources.js";
import { CaptionStream, asrUrl } from "./asr-client.js";
import { CaptionView } from "./captions.js";
import { download, exportBaseName, toSrt, toText } from "./export.js";
import { LatencyMeter } from "./latency.js";
import { UploadError, UploadUnavailable, segmentAsFinal, transcribeUpload } from "./upload.js";

const $ = (id) => document.getElementById(id);
const ui = {
  connection: $("connection"),
  server: $("server"),
  notice: $("notice"),
  start: $("start"),
  stop: $("stop"),
  file: $("file"),
  language: $("language"),
  itn: $("itn"),
  diarize: $("diarize"),
  token: $("token"),
  captions: $("captions"),
  level: $("level"),
  latency: $("latency"),
  progress: $("progress"),
  summary: $("summary"),
  toasts: $("toasts"),
};

const STATE_LABELS = {
  idle: "idle",
  connecting: "connecting…",
  live: "live",
  reconnecting: "reconnecting…",
  stopping: "finishing…",
  error: "error",
};
const READYZ_POLL_MS = 20000;
const TOAST_MS = 6000;

const view = new CaptionView(ui.captions);
let latency = new LatencyMeter();
let run = null; // the capture in progress: {stream, source?, abort?, stopping}

// ---- settings -------------------------------------------------------------------------

const store = {
  get: (key) => {
    try {
      return localStorage.getItem(`sensevoice.${key}`);
    } catch {
      return null; // storage disabled (private mode, file://)
    }
  },
  set: (key, value) => {
    try {
      localStorage.setItem(`sensevoice.${key}`, value);
    } catch {
      /* not persisted: the setting still applies to this page */
    }
  },
};

function loadSettings() {
  const params = new URLSearchParams(location.search);
  ui.token.value = params.get("token") ?? store.get("token") ?? "";
  ui.language.value = params.get("language") ?? store.get("language") ?? "auto";
  if (!ui.language.value) ui.language.value = "auto";
  const itn = params.get("itn") ?? store.get("itn");
  if (itn !== null) ui.itn.checked = itn !== "false";
  const diarize = params.get("diarize") ?? store.get("diarize");
  if (diarize !== null) ui.diarize.checked = diarize === "true";
  setCaptionScale(Number(store.get("scale")) || 1);
  ui.token.addEventListener("change", () => store.set("token", ui.token.value));
  ui.language.addEventListener("change", () => store.set("language", ui.language.value));
  ui.itn.addEventListener("change", () => store.set("itn", String(ui.itn.checked)));
  ui.diarize.addEventListener("change", () => store.set("diarize", String(ui.diarize.checked)));
}

function setCaptionScale(scale) {
  const clamped = Math.min(2.5, Math.max(0.6, scale));
  document.documentElement.style.setProperty("--caption-scale", clamped.toFixed(2));
  store.set("scale", clamped.toFixed(2));
  return clamped;
}

// ---- status and messages -----------------------------------------------------------------

function showNotice(text, kind = "error") {
  ui.notice.textContent = text;
  ui.notice.dataset.kind = kind;
  ui.notice.hidden = !text;
  delete ui.notice.dataset.cause;
}

function toast(text, kind = "warning") {
  const node = document.createElement("div");
  node.className = "toast";
  node.dataset.kind = kind;
  node.textContent = text;
  ui.toasts.append(node);
  setTimeout(() => node.remove(), TOAST_MS);
}

function showConnection(state, detail) {
  ui.connection.dataset.state = state;
  ui.connection.querySelector(".label").textContent = STATE_LABELS[state] ?? state;
  ui.connection.title = detail || "";
  if (state === "error") {
    showNotice(`Connection failed: ${detail}`);
    checkServer();
  } else if (state === "reconnecting" && detail) {
    toast(`Connection lost: ${detail}`);
  }
  if (state === "reconnecting" || state === "live") checkServer(); // the badge follows outages
}

const UNREACHABLE =
  "The server cannot be reached. Captions go on when it is back (this notice clears itself).";

async function checkServer() {
  try {
    const response = await fetch("readyz", { cache: "no-store" });
    // 503 answers say why: {"status": "loading"} while the model loads, for example.
    const status = await response.json().then((body) => body?.status, () => null);
    ui.server.dataset.state = response.ok ? "ready" : "not-ready";
    ui.server.textContent = response.ok ? "server ready" : `server ${status ?? "not ready"}`;
    // the server answers again: an outage notice (ours, or a Start that failed for it) is stale
    if (ui.notice.dataset.cause === "unreachable") showNotice("");
  } catch {
    ui.server.dataset.state = "down";
    ui.server.textContent = "server unreachable";
    if (ui.notice.hidden) {
      showNotice(UNREACHABLE);
      ui.notice.dataset.cause = "unreachable";
    }
  }
}

function showLatency() {
  const fmt = (ms) => (ms === null ? "–" : `${Math.round(ms)} ms`);
  ui.latency.textContent = `latency ${fmt(latency.last)} · median ${fmt(latency.median)}`;
}

function showLevel(rms) {
  // -60..0 dBFS onto 0..100 %
  const db = 20 * Math.log10(Math.max(rms, 1e-6));
  ui.level.style.width = `${Math.max(0, Math.min(100, ((db + 60) / 60) * 100))}%`;
}

function handleMessage(message, session) {
  view.handle(message, session);
  switch (message.type) {
    case "ready":
      ui.summary.textContent = `session ${message.session_id}`;
      delete ui.summary.dataset.ended;
      break;
    case "speech_start":
      latency.speechStart(session, message);
      break;
    case "partial":
    case "final":
      if (latency.words(session, message) !== null) showLatency();
      if (message.type === "final" && message.error) {
        toast(`segment ${message.segment_id} could not be decoded: ${message.error.message}`);
      }
      break;
    case "warning": // e.g. hotwords the model cannot spell: skipped, the session goes on
      toast(`${message.code}: ${message.message}`);
      break;
    case "error":
      // Fatal errors are reported with the close that follows.
      if (!message.fatal && message.code !== "decode_failed") {
        toast(`${message.code}: ${message.message}`);
      }
      break;
    case "end": {
      const seconds = (message.audio_ms / 1000).toFixed(1);
      ui.summary.textContent =
        `ended: ${message.segments} segments, ${seconds} s of audio, ` +
        `${message.partials_sent} partials (${message.partials_skipped} skipped)`;
      ui.summary.dataset.ended = "true";
      break;
    }
  }
}

// ---- running -------------------------------------------------------------------------

function setRunning(running) {
  ui.start.disabled = running || !window.isSecureContext;
  ui.file.disabled = running;
  ui.file.parentElement.classList.toggle("disabled", running);
  ui.stop.disabled = !running;
  for (const input of [ui.language, ui.itn, ui.diarize, ui.token]) input.disabled = running;
  document.body.classList.toggle("running", running);
}

function newRun() {
  showNotice("");
  view.startRun();
  latency = new LatencyMeter();
  showLatency();
  const current = { stopping: false };
  current.stream = new CaptionStream({
    url: () =>
      asrUrl({
        language: ui.language.value,
        itn: ui.itn.checked,
        diarize: ui.diarize.checked,
        token: ui.token.value.trim(),
      }),
    onMessage: handleMessage,
    onState: (state, detail) => {
      showConnection(state, detail);
      if (state === "error" && run === current) finishRun(current);
    },
  });
  run = current;
  setRunning(true);
  holdScreenAwake(current);
  return current;
}

async function holdScreenAwake(current) {
  try {
    current.wakeLock = await navigator.wakeLock?.request("screen");
  } catch {
    /* not granted: captions still work, the screen may dim */
  }
}

async function finishRun(current) {
  current.abort?.abort();
  await current.source?.stop();
  current.wakeLock?.release().catch(() => {});
  ui.progress.hidden = true;
  showLevel(0);
  if (run === current) {
    run = null;
    setRunning(false);
  }
}

async function startMicrophone() {
  if (run) return;
  const current = newRun();
  try {
    current.source = await openMicrophone({
      onFrame: (frame) => current.stream.pushAudio(frame),
      onLevel: showLevel,
    });
  } catch (err) {
    showNotice(err instanceof SourceError ? err.message : `Microphone failed: ${err}`);
    if (/server cannot be reached/.test(err?.message ?? "")) ui.notice.dataset.cause = "unreachable";
    await finishRun(current);
    return;
  }
  if (current.stopping) {
    await current.source.stop(); // Stop was pressed while the permission prompt was up
    return;
  }
  current.stream.start();
}

async function captionFile(file) {
  if (run || !file) return;
  const current = newRun();
  current.abort = new AbortController();
  ui.progress.hidden = false;
  ui.progress.textContent = `uploading ${file.name}…`;
  const session = { index: 0, offsetMs: 0 }; // one upload: one timeline from 0
  let captions = 0;
  const started = performance.now();
  showConnection("live", "transcribing an upload");
  try {
    await transcribeUpload(file, {
      language: ui.language.value,
      token: ui.token.value.trim(),
      signal: current.abort.signal,
      onSegment: (segment) => {
        captions += 1;
        view.handle(segmentAsFinal(segment), session);
        ui.progress.textContent = `${file.name}: ${captions} captions, up to ${segment.end.toFixed(1)} s`;
      },
    });
    const seconds = ((performance.now() - started) / 1000).toFixed(1);
    ui.summary.textContent = `${file.name}: ${captions} captions in ${seconds} s (uploaded)`;
    ui.summary.dataset.ended = "true";
    showConnection("idle");
  } catch (err) {
    if (err instanceof UploadUnavailable) {
      await finishRun(current);
      return streamFile(file); // an older server: caption it live, at real time
    }
    if (err?.name !== "AbortError") {
      showNotice(err instanceof UploadError ? `The server could not caption ${file.name}: ${err.message}` : `Upload failed: ${err}`);
    }
    showConnection("idle");
  }
  await finishRun(current);
}

// The file played into the WebSocket at real time, as a microphone would: for a server
// without the upload API.
async function streamFile(file) {
  if (run || !file) return;
  const current = newRun();
  ui.progress.hidden = false;
  ui.progress.textContent = `decoding ${file.name}…`;
  let pcm;
  try {
    pcm = await decodeFile(file);
  } catch (err) {
    showNotice(err instanceof SourceError ? err.message : `Decoding failed: ${err}`);
    await finishRun(current);
    return;
  }
  current.abort = new AbortController();
  current.stream.start();
  const total = (pcm.length / 16000).toFixed(1);
  const finished = await playPcm(pcm, {
    onFrame: (frame) => current.stream.pushAudio(frame),
    onLevel: showLevel,
    onProgress: (sent) => {
      ui.progress.textContent = `${file.name} ${(sent / 16000).toFixed(1)} / ${total} s`;
    },
    signal: current.abort.signal,
  });
  if (finished) await stopRun();
}

async function stopRun() {
  const current = run;
  if (!current || current.stopping) return;
  current.stopping = true;
  ui.stop.disabled = true;
  // Deliver the last captured audio before `stop`: nothing may follow it.
  current.abort?.abort();
  await current.source?.stop();
  await current.stream.stop();
  await finishRun(current);
}

// ---- wiring --------------------------------------------------------------------------

function exportAs(kind) {
  if (view.finals.length === 0) {
    toast("Nothing to export yet.", "info");
    return;
  }
  const name = exportBaseName();
  if (kind === "srt") download(`${name}.srt`, toSrt(view.finals), "application/x-subrip");
  else download(`${name}.txt`, toText(view.finals));
}

function init() {
  loadSettings();
  setRunning(false);
  showLatency();
  if (!window.isSecureContext) {
    showNotice(
      "This page is not a secure context, so the browser will not open the microphone. " +
        "Open it as http://localhost:PORT (or 127.0.0.1) on the server's machine, or over " +
        "https (start the server with --certfile and --keyfile). Captioning a file still works.",
      "warning",
    );
  }
  $("controls").addEventListener("submit", (event) => event.preventDefault());
  ui.start.addEventListener("click", startMicrophone);
  ui.stop.addEventListener("click", stopRun);
  ui.file.addEventListener("change", () => {
    const file = ui.file.files?.[0];
    ui.file.value = ""; // choosing the same file again fires `change` again
    captionFile(file);
  });
  $("export-txt").addEventListener("click", () => exportAs("txt"));
  $("export-srt").addEventListener("click", () => exportAs("srt"));
  $("clear").addEventListener("click", () => view.clear());
  const scale = () => Number(getComputedStyle(document.documentElement).getPropertyValue("--caption-scale")) || 1;
  $("smaller").addEventListener("click", () => setCaptionScale(scale() / 1.15));
  $("larger").addEventListener("click", () => setCaptionScale(scale() * 1.15));
  window.addEventListener("pagehide", () => run?.stream.abort());
  checkServer();
  setInterval(() => {
    if (!run) checkServer();
  }, READYZ_POLL_MS);
}

init();

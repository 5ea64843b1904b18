// Protocol v1 client (docs/protocol.md) for the browser: one WebSocket per session,
// reconnection with backoff after an unexpected drop, and a send log for latency.

const SAMPLE_RATE = 16000;
const QUEUE_LIMIT_SAMPLES = 10 * SAMPLE_RATE; // audio kept while (re)connecting
const SEND_LOG_LIMIT = 3000; // frames remembered for latency (2 min of 40 ms frames)
const BACKOFF_FIRST_MS = 500;
const BACKOFF_MAX_MS = 10000;
const END_TIMEOUT_MS = 20000; // how long stop() waits for `end`

/** Close codes after which a new session would fail the same way. */
const FATAL_CLOSE_CODES = new Set([1003, 1008, 1009]);

/**
 * The WebSocket URL for this page: same host and port, ws/wss matching http/https, and
 * `v1/asr` next to the page (so `/v1/asr` when served at `/`, and a reverse proxy may
 * mount the demo under a prefix).
 */
export function asrUrl({ language, itn, token, diarize = false, base = window.location.href }) {
  const url = new URL("v1/asr", base);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.search = new URLSearchParams({ language, itn: String(itn), sample_rate: String(SAMPLE_RATE) });
  if (diarize) url.searchParams.set("diarize", "true"); // speakers (docs/diarization.md)
  if (token) url.searchParams.set("token", token);
  url.hash = "";
  return url.href;
}

/** One WebSocket session: its place on the stream's timeline and when each sample left. */
class Session {
  constructor(index, socket) {
    this.index = index; // 0 for the first session of a stream, then 1, 2, ... on reconnects
    this.socket = socket;
    this.offsetSamples = null; // stream sample at this session's sample 0
    this.sentSamples = 0;
    this.sendLog = []; // [sessionSampleStart, performance.now()] per frame, oldest first
    this.ready = null; // the `ready` message
    this.lastError = null; // the last `error` message
    this.ended = null; // the `end` message
  }

  /** Stream-timeline milliseconds of this session's time 0. */
  get offsetMs() {
    return ((this.offsetSamples ?? 0) / SAMPLE_RATE) * 1000;
  }

  /** performance.now() when the frame holding session time `ms` was sent, or null. */
  sentAt(ms) {
    const sample = Math.round((ms / 1000) * SAMPLE_RATE);
    const log = this.sendLog;
    if (log.length === 0 || sample < log[0][0]) return log.length ? log[0][1] : null;
    let lo = 0;
    let hi = log.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (log[mid][0] <= sample) lo = mid;
      else hi = mid - 1;
    }
    return log[lo][1];
  }

  send(frame) {
    this.sendLog.push([this.sentSamples, performance.now()]);
    if (this.sendLog.length > SEND_LOG_LIMIT) this.sendLog.splice(0, this.sendLog.length - SEND_LOG_LIMIT);
    this.sentSamples += frame.length;
    this.socket.send(frame);
  }
}

/**
 * Streams audio to the server and reports what happens.
 *
 * `onState(state, detail)`: "connecting", "live", "reconnecting", "stopping", "idle" or
 * "error" (detail: a readable reason). `onMessage(message, session)`: every server message;
 * `session.offsetMs` places its times on the stream's timeline, `session.sentAt(ms)` says
 * when that audio was sent. Call `pushAudio()` with 16 kHz Int16 frames from the moment
 * `start()` is called; audio is queued while no session is open.
 */
export class CaptionStream {
  constructor({ url, onState, onMessage }) {
    this.url = url; // () => string, rebuilt for each session
    this.onState = onState;
    this.onMessage = onMessage;
    this.state = "idle";
    this.session = null;
    this.sessionCount = 0;
    this.queue = [];
    this.queuedSamples = 0;
    this.pushedSamples = 0;
    this.attempt = 0;
    this.retryTimer = null;
    this.stopRequested = false;
    this.endWaiter = null;
  }

  start() {
    this.connect();
  }

  pushAudio(frame) {
    if (this.stopRequested) return; // `stop` was sent: the server rejects later audio
    const start = this.pushedSamples;
    this.pushedSamples += frame.length;
    const session = this.session;
    if (session?.socket.readyState === WebSocket.OPEN && this.queue.length === 0) {
      session.offsetSamples ??= start;
      session.send(frame);
      return;
    }
    this.queue.push([start, frame]);
    this.queuedSamples += frame.length;
    while (this.queuedSamples > QUEUE_LIMIT_SAMPLES) {
      this.queuedSamples -= this.queue.shift()[1].length;
    }
  }

  /** End the stream: send `stop`, wait for `end` (or give up). Resolves with `end` or null. */
  async stop() {
    if (this.state === "idle" || this.state === "error") return null;
    this.stopRequested = true;
    clearTimeout(this.retryTimer);
    const session = this.session;
    if (!session || session.socket.readyState !== WebSocket.OPEN) {
      // Nothing is listening: drop the queued audio.
      session?.socket.close();
      this.setState("idle");
      return null;
    }
    this.flushQueue(session);
    this.setState("stopping");
    session.socket.send(JSON.stringify({ type: "stop" }));
    const end = await new Promise((resolve) => {
      this.endWaiter = resolve;
      setTimeout(() => resolve(null), END_TIMEOUT_MS);
    });
    this.endWaiter = null;
    if (session.socket.readyState !== WebSocket.CLOSED) session.socket.close(1000);
    this.setState("idle", end ? "" : "the server did not confirm the end of the stream");
    return end;
  }

  /** Drop the connection at once (page unload). */
  abort() {
    this.stopRequested = true;
    clearTimeout(this.retryTimer);
    this.session?.socket.close();
    this.setState("idle");
  }

  setState(state, detail = "") {
    this.state = state;
    this.onState(state, detail);
  }

  connect() {
    this.setState(this.sessionCount === 0 ? "connecting" : "reconnecting");
    const socket = new WebSocket(this.url());
    socket.binaryType = "arraybuffer";
    const session = new Session(this.sessionCount++, socket);
    this.session = session;
    socket.onopen = () => this.flushQueue(session);
    socket.onmessage = (event) => this.receive(session, event.data);
    socket.onclose = (event) => this.closed(session, event);
  }

  flushQueue(session) {
    if (this.queue.length === 0) return;
    session.offsetSamples ??= this.queue[0][0];
    for (const [, frame] of this.queue) session.send(frame);
    this.queue = [];
    this.queuedSamples = 0;
  }

  receive(session, data) {
    if (typeof data !== "string") return; // the server sends only JSON text
    let message;
    try {
      message = JSON.parse(data);
    } catch {
      return;
    }
    switch (message.type) {
      case "ready":
        session.ready = message;
        this.attempt = 0;
        if (!this.stopRequested) this.setState("live");
        break;
      case "error":
        session.lastError = message;
        break;
      case "end":
        session.ended = message;
        this.endWaiter?.(message);
        break;
    }
    this.onMessage(message, session);
  }

  closed(session, event) {
    if (session !== this.session) return;
    if (this.stopRequested) {
      this.endWaiter?.(session.ended);
      if (this.state !== "stopping") this.setState("idle");
      return;
    }
    const reason = closeReason(session, event);
    const neverReady = session.ready === null;
    const expired = session.lastError?.code === "max_session_duration";
    if ((FATAL_CLOSE_CODES.has(event.code) && !expired) || (neverReady && session.index === 0)) {
      this.setState("error", reason);
      return;
    }
    // Unexpected drop: a new session after a pause; the transcript stays on the page.
    const delay = expired
      ? 0
      : Math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ** this.attempt) * (0.75 + Math.random() / 2);
    this.attempt++;
    this.setState("reconnecting", `${reason}; retrying in ${(delay / 1000).toFixed(1)} s`);
    this.retryTimer = setTimeout(() => this.connect(), delay);
  }
}

function closeReason(session, event) {
  const error = session.lastError;
  if (error?.fatal) return `${error.message || error.code} (close ${event.code})`;
  if (event.reason) return `${event.reason} (close ${event.code})`;
  switch (event.code) {
    case 1001:
      return "the server is restarting";
    case 1003:
      return "the server refused the audio format (close 1003)";
    case 1008:
      return "the server ended the session (policy, close 1008)";
    case 1009:
      return "an audio frame was too large (close 1009)";
    case 1011:
      return "internal server error (close 1011)";
    case 1006:
      return session.ready === null
        ? "could not connect (server down, wrong token, or origin not allowed)"
        : "the connection dropped";
    default:
      return `connection closed (code ${event.code})`;
  }
}

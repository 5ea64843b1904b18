// A file captioned through the server's upload API (POST v1/audio/transcriptions with
// stream=true): the server decodes the whole file as fast as the model goes, in the
// background behind live sessions, and each utterance comes back as a server-sent event
// as soon as it is decoded. Streaming the file at real time over the WebSocket took the
// file's whole duration.

/** The upload API is not there (an older server, or a proxy that routes only /v1/asr). */
export class UploadUnavailable extends Error {}

/** The server refused the file or failed; `message` is its own explanation. */
export class UploadError extends Error {}

/**
 * Upload `file` and call `onSegment(segment)` for each utterance as it is decoded
 * (`segment`: verbose_json's, with `start`/`end` in seconds, `text`, `emotion`, `event`,
 * `sensevoice_language`). Resolves with the whole text; `signal` aborts.
 */
export async function transcribeUpload(file, { language, token, signal, onSegment, base }) {
  const form = new FormData();
  form.append("file", file, file.name);
  form.append("model", "sensevoice");
  form.append("stream", "true");
  form.append("include[]", "segments");
  if (language && language !== "auto") form.append("language", language);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const url = new URL("v1/audio/transcriptions", base ?? window.location.href);
  const response = await fetch(url, { method: "POST", body: form, headers, signal });
  if (!response.ok || !response.body) {
    const body = await response.json().catch(() => null);
    const code = body?.error?.code;
    if (response.status === 404 || response.status === 405 || code === "files_disabled") {
      throw new UploadUnavailable(`the server takes no uploads (HTTP ${response.status})`);
    }
    throw new UploadError(body?.error?.message ?? `HTTP ${response.status}`);
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += value;
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const event = parseEvent(buffered.slice(0, end));
      buffered = buffered.slice(end + 2);
      if (!event) continue; // a keep-alive comment
      if (event.error) throw new UploadError(event.error.message ?? "transcription failed");
      if (event.type === "transcript.text.delta" && event.segment) onSegment(event.segment);
      if (event.type === "transcript.text.done") return event.text;
    }
  }
  throw new UploadError("the server closed the stream before the transcript was done");
}

function parseEvent(block) {
  const data = block
    .split("\n")
    .filter((line) => line.startsWith("data:"))
    .map((line) => line.slice(5).trimStart())
    .join("\n");
  return data ? JSON.parse(data) : null;
}

/** A segment as the caption view's `final` message (times in ms). */
export function segmentAsFinal(segment) {
  return {
    type: "final",
    segment_id: segment.id,
    start_ms: Math.round(segment.start * 1000),
    end_ms: Math.round(segment.end * 1000),
    text: segment.text,
    language: segment.sensevoice_language ?? null,
    emotion: segment.emotion ?? null,
    event: segment.event ?? null,
  };
}

// Transcript export: plain text and SubRip (.srt) built from the finals' start/end times.

/** One line per final segment. */
export function toText(finals) {
  return finals.map((f) => f.text).join("\n") + (finals.length ? "\n" : "");
}

function srtTime(ms) {
  const t = Math.max(0, Math.round(ms));
  const pad = (n, width = 2) => String(n).padStart(width, "0");
  const hours = Math.floor(t / 3600000);
  const minutes = Math.floor(t / 60000) % 60;
  const seconds = Math.floor(t / 1000) % 60;
  return `${pad(hours)}:${pad(minutes)}:${pad(seconds)},${pad(t % 1000, 3)}`;
}

/** SubRip cues numbered from 1, one per final segment. */
export function toSrt(finals) {
  return finals
    .map((f, i) => `${i + 1}\n${srtTime(f.startMs)} --> ${srtTime(f.endMs)}\n${f.text}\n`)
    .join("\n");
}

/** Offer `text` as a file download named `name`. */
export function download(name, text, type = "text/plain") {
  const url = URL.createObjectURL(new Blob([text], { type: `${type};charset=utf-8` }));
  const link = document.createElement("a");
  link.href = url;
  link.download = name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

/** "transcript-20240131-142501" in local time. */
export function exportBaseName(date = new Date()) {
  const pad = (n) => String(n).padStart(2, "0");
  const day = `${date.getFullYear()}${pad(date.getMonth() + 1)}${pad(date.getDate())}`;
  const time = `${pad(date.getHours())}${pad(date.getMinutes())}${pad(date.getSeconds())}`;
  return `transcript-${day}-${time}`;
}

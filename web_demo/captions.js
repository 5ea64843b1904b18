// Live captions: one block per final segment, plus the open segment's partial, which is
// replaced on every revision (never appended).

const EMOTIONS = {
  HAPPY: ["😊", "happy"],
  SAD: ["😢", "sad"],
  ANGRY: ["😠", "angry"],
  NEUTRAL: ["😐", "neutral"],
  FEARFUL: ["😨", "fearful"],
  DISGUSTED: ["🤢", "disgusted"],
  SURPRISED: ["😮", "surprised"],
};

// Plain speech gets no icon: a badge on every line would only add noise.
const EVENTS = {
  BGM: ["🎼", "background music"],
  Applause: ["👏", "applause"],
  Laughter: ["😀", "laughter"],
  Cry: ["😭", "crying"],
  Sneeze: ["🤧", "sneeze"],
  Cough: ["😷", "cough"],
  Breath: ["💨", "breath"],
  Sing: ["🎤", "singing"],
  Speech_Noise: ["🔊", "noise"],
};

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const SPEAKER_COLOURS = 6; // style.css has .speaker-0 ... .speaker-5

/** Badge elements for a result's tags: `.badge.lang`, `.badge.emotion`, `.badge.event`. */
export function badges(result) {
  const out = [];
  if (result.language && result.language !== "nospeech") {
    const badge = element("span", "badge lang", result.language.toUpperCase());
    badge.dataset.language = result.language;
    badge.title = `language: ${result.language}`;
    out.push(badge);
  }
  const emotion = EMOTIONS[result.emotion];
  if (emotion) {
    const badge = element("span", "badge emotion", emotion[0]);
    badge.dataset.emotion = result.emotion;
    badge.title = badge.ariaLabel = emotion[1];
    out.push(badge);
  }
  const event = EVENTS[result.event];
  if (event) {
    const badge = element("span", "badge event", event[0]);
    badge.dataset.event = result.event;
    badge.title = badge.ariaLabel = event[1];
    out.push(badge);
  }
  return out;
}

export function formatClock(ms) {
  const total = Math.max(0, Math.floor(ms / 100)); // tenths of a second
  const tenths = total % 10;
  const seconds = Math.floor(total / 10) % 60;
  const minutes = Math.floor(total / 600);
  return `${minutes}:${String(seconds).padStart(2, "0")}.${tenths}`;
}

/**
 * Renders server messages into `container` and keeps the finals for export.
 * Finals carry `data-segment-id`, `data-session` and `data-language|emotion|event`.
 */
export class CaptionView {
  constructor(container) {
    this.container = container;
    this.finals = []; // {session, segmentId, startMs, endMs, text, language, emotion, event}
    this.runOffsetMs = 0; // where this run's clock starts on the transcript's one timeline
    this.partial = null; // element of the open segment, or null
    this.followTail = true;
    container.addEventListener("scroll", () => {
      const slack = container.scrollHeight - container.scrollTop - container.clientHeight;
      this.followTail = slack < 40;
    });
  }

  /** `session` supplies the offset of its times on the stream timeline and its index. */
  handle(message, session) {
    switch (message.type) {
      case "ready":
        // A new session after a drop: the old session's open segment will never close.
        this.partial?.remove();
        this.partial = null;
        break;
      case "speech_start":
        this.showPartial(session, message, "", "");
        break;
      case "partial": {
        const text = message.text ?? "";
        const stable = message.stable_text ?? "";
        // stable_text is normally a prefix; if it ever is not, show it all as provisional.
        const split = text.startsWith(stable) ? stable.length : 0;
        this.showPartial(session, message, text.slice(0, split), text.slice(split));
        break;
      }
      case "final":
        this.addFinal(session, message);
        break;
    }
  }

  showPartial(session, message, stable, rest) {
    if (!this.partial) {
      this.partial = element("div", "segment partial");
      this.container.append(this.partial);
    }
    const node = this.partial;
    node.dataset.segmentId = message.segment_id;
    node.dataset.session = session.index;
    const textNode = element("p", "text");
    textNode.append(element("span", "stable", stable), element("span", "unstable", rest));
    if (!stable && !rest) textNode.append(element("span", "listening", "…"));
    node.replaceChildren(this.meta(session, message), textNode);
    this.scroll();
  }

  addFinal(session, message) {
    this.partial?.remove();
    this.partial = null;
    const text = (message.text ?? "").trim();
    const startMs = this.runOffsetMs + session.offsetMs + message.start_ms;
    const endMs = this.runOffsetMs + session.offsetMs + message.end_ms;
    if (!text) return; // silence or a failed decode: nothing to caption
    const record = {
      session: session.index,
      segmentId: message.segment_id,
      startMs,
      endMs,
      text,
      language: message.language ?? null,
      emotion: message.emotion ?? null,
      event: message.event ?? null,
    };
    this.finals.push(record);
    const node = element("div", "segment final");
    node.dataset.segmentId = message.segment_id;
    node.dataset.session = session.index;
    for (const key of ["language", "emotion", "event"]) {
      if (record[key]) node.dataset[key] = record[key];
    }
    node.append(this.meta(session, message), this.speakerText(message, text));
    this.container.append(node);
    this.scroll();
  }

  meta(session, message) {
    const meta = element("div", "meta");
    const time = element("span", "time", formatClock(session.offsetMs + message.start_ms));
    meta.append(time, ...badges(message));
    if (message.speaker) meta.append(this.speakerBadge(message.speaker));
    return meta;
  }

  /** A diarized final's text, each speaker's run of words in that speaker's colour. */
  speakerText(message, text) {
    const node = element("p", "text");
    const words = message.words ?? [];
    if (!message.speaker || !words.length || words.some((w) => !w.speaker)) {
      node.textContent = text;
      return node;
    }
    let run = null;
    for (const word of words) {
      if (!run || run.dataset.speaker !== word.speaker) {
        if (run) node.append(" ");
        run = element("span", `speaker-run ${this.speakerClass(word.speaker)}`);
        run.dataset.speaker = word.speaker;
        run.title = `speaker ${word.speaker}`;
        node.append(run);
      } else {
        run.append(" ");
      }
      run.append(word.word);
    }
    return node;
  }

  speakerBadge(label) {
    const badge = element("span", `badge speaker ${this.speakerClass(label)}`, label);
    badge.dataset.speaker = label;
    badge.title = `speaker ${label}`;
    return badge;
  }

  /** One of SPEAKER_COLOURS colours per speaker, in the order they are first heard. */
  speakerClass(label) {
    this.speakerColours ??= new Map();
    if (!this.speakerColours.has(label)) this.speakerColours.set(label, this.speakerColours.size);
    return `speaker-${this.speakerColours.get(label) % SPEAKER_COLOURS}`;
  }

  scroll() {
    if (this.followTail) this.container.scrollTop = this.container.scrollHeight;
  }

  /** A new Start: its sessions count time from 0 again; on the exported timeline its
   * audio follows the last final so far, so cues never go backwards. */
  startRun() {
    this.runOffsetMs = this.finals.at(-1)?.endMs ?? 0;
  }

  clear() {
    this.runOffsetMs = 0;
    this.finals = [];
    this.partial = null;
    this.container.replaceChildren();
  }
}

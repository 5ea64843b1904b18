// Speech-to-first-words latency, measured from the client's own send log.
//
// When `speech_start` arrives, the segment's start sample is looked up in the session's
// send log: the wall time at which that audio left the page. The latency is the time from
// then to the first partial or final with text for the segment. `start_ms` includes the
// server's pre-roll, so this slightly overstates what a listener perceives.

export class LatencyMeter {
  constructor(keep = 50) {
    this.keep = keep; // how many recent measurements the median covers
    this.pending = new Map(); // "session:segment" -> performance.now() of the start sample
    this.values = [];
  }

  speechStart(session, message) {
    const sentAt = session.sentAt(message.start_ms);
    if (sentAt !== null) this.pending.set(`${session.index}:${message.segment_id}`, sentAt);
  }

  /** For a partial or final: the latency in ms when it is the segment's first words. */
  words(session, message) {
    const key = `${session.index}:${message.segment_id}`;
    const sentAt = this.pending.get(key);
    if (sentAt === undefined) return null;
    if (message.type === "final") this.pending.delete(key);
    if (!message.text?.trim()) return null;
    this.pending.delete(key);
    const ms = performance.now() - sentAt;
    this.values.push(ms);
    if (this.values.length > this.keep) this.values.shift();
    return ms;
  }

  get last() {
    return this.values.at(-1) ?? null;
  }

  get median() {
    if (this.values.length === 0) return null;
    const sorted = [...this.values].sort((a, b) => a - b);
    const mid = sorted.length >> 1;
    return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
  }
}

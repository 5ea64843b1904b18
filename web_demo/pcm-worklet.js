// AudioWorklet: microphone audio at the context's native rate -> 16 kHz mono Int16 frames.
//
// Resampling happens here rather than through `new AudioContext({sampleRate: 16000})`
// because Firefox refuses a 16 kHz context connected to a microphone at another rate.
// The resampler is a windowed-sinc (Kaiser) interpolator whose cutoff sits below the
// output Nyquist, so 44.1/48 kHz input does not alias into the speech band. Its state
// (input history and output position) carries across the 128-sample render quanta.

const KAISER_BETA = 8.0; // about 80 dB stop-band attenuation
const ZERO_CROSSINGS = 16; // sinc lobes on each side of the centre tap
const TABLE_PHASES = 512; // kernel samples per input sample (linear interpolation between)
const ROLLOFF = 0.92; // cutoff as a fraction of the output Nyquist frequency

function besselI0(x) {
  let sum = 1;
  let term = 1;
  for (let k = 1; k < 50; k++) {
    term *= (x / (2 * k)) ** 2;
    sum += term;
    if (term < sum * 1e-12) break;
  }
  return sum;
}

/** Streaming windowed-sinc resampler for mono Float32 blocks of any length. */
class SincResampler {
  constructor(inputRate, outputRate) {
    this.inputRate = inputRate;
    this.outputRate = outputRate;
    this.passthrough = inputRate === outputRate;
    // Cutoff in cycles per input sample; below both Nyquist frequencies.
    const cutoff = 0.5 * Math.min(1, outputRate / inputRate) * ROLLOFF;
    this.halfWidth = ZERO_CROSSINGS / (2 * cutoff); // kernel half-width, input samples
    const size = Math.ceil(this.halfWidth * TABLE_PHASES) + 2;
    this.table = new Float32Array(size);
    const i0beta = besselI0(KAISER_BETA);
    for (let j = 0; j < size; j++) {
      const x = j / TABLE_PHASES;
      const r = x / this.halfWidth;
      if (r >= 1) break; // rest stays zero
      const arg = 2 * cutoff * x;
      const sinc = arg === 0 ? 1 : Math.sin(Math.PI * arg) / (Math.PI * arg);
      const window = besselI0(KAISER_BETA * Math.sqrt(1 - r * r)) / i0beta;
      this.table[j] = 2 * cutoff * sinc * window;
    }
    this.history = new Float32Array(4096);
    this.historyStart = 0; // absolute input index of history[0]
    this.historyLength = 0;
    this.outputCount = 0; // absolute index of the next output sample
  }

  /** Feed `block` (input rate); `emit(sample)` is called for each output sample ready. */
  process(block, emit) {
    if (this.passthrough) {
      for (let i = 0; i < block.length; i++) emit(block[i]);
      return;
    }
    this.append(block);
    const { table, halfWidth, history, historyStart } = this;
    const available = historyStart + this.historyLength;
    for (;;) {
      // Exact rational position avoids drift over long sessions.
      const centre = (this.outputCount * this.inputRate) / this.outputRate;
      const last = Math.floor(centre + halfWidth);
      if (last >= available) break;
      // Samples before the stream began count as silence.
      const first = Math.max(0, Math.ceil(centre - halfWidth));
      let acc = 0;
      for (let i = first; i <= last; i++) {
        const d = Math.abs(centre - i) * TABLE_PHASES;
        const j = d | 0;
        const w = table[j] + (d - j) * (table[j + 1] - table[j]);
        acc += history[i - historyStart] * w;
      }
      emit(acc);
      this.outputCount++;
    }
    this.discardUpTo(Math.ceil((this.outputCount * this.inputRate) / this.outputRate - halfWidth));
  }

  append(block) {
    const needed = this.historyLength + block.length;
    if (needed > this.history.length) {
      const bigger = new Float32Array(Math.max(needed, this.history.length * 2));
      bigger.set(this.history.subarray(0, this.historyLength));
      this.history = bigger;
    }
    this.history.set(block, this.historyLength);
    this.historyLength = needed;
  }

  discardUpTo(absoluteIndex) {
    const drop = Math.min(absoluteIndex - this.historyStart, this.historyLength);
    if (drop <= 0) return;
    this.history.copyWithin(0, drop, this.historyLength);
    this.historyStart += drop;
    this.historyLength -= drop;
  }
}

/**
 * processorOptions: {targetRate = 16000, frameSamples = 640}.
 * Posts {type: "frame", pcm: ArrayBuffer (Int16 LE), level: RMS 0..1} per frame, and on a
 * {type: "flush"} message the partial frame still pending, then {type: "flushed"}.
 */
class PcmWorkletProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { targetRate = 16000, frameSamples = 640 } = options.processorOptions ?? {};
    this.resampler = new SincResampler(sampleRate, targetRate);
    this.frameSamples = frameSamples;
    this.frame = new Int16Array(frameSamples);
    this.filled = 0;
    this.energy = 0;
    this.mono = new Float32Array(128);
    this.running = true;
    this.emit = (s) => this.push(s);
    this.port.onmessage = (event) => {
      if (event.data?.type === "flush") {
        this.postFrame(this.filled);
        this.port.postMessage({ type: "flushed" });
      } else if (event.data?.type === "close") {
        this.running = false;
      }
    };
  }

  push(sample) {
    const s = sample > 1 ? 1 : sample < -1 ? -1 : sample;
    this.energy += s * s;
    this.frame[this.filled++] = s < 0 ? Math.round(s * 32768) : Math.round(s * 32767);
    if (this.filled === this.frameSamples) this.postFrame(this.filled);
  }

  postFrame(length) {
    if (length === 0) return;
    const pcm = length === this.frameSamples ? this.frame : this.frame.slice(0, length);
    const level = Math.sqrt(this.energy / length);
    this.port.postMessage({ type: "frame", pcm: pcm.buffer, level }, [pcm.buffer]);
    this.frame = new Int16Array(this.frameSamples);
    this.filled = 0;
    this.energy = 0;
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || channels.length === 0) return this.running; // input not connected yet
    const n = channels[0].length;
    if (this.mono.length !== n) this.mono = new Float32Array(n);
    const mono = this.mono;
    mono.set(channels[0]);
    if (channels.length > 1) {
      for (let c = 1; c < channels.length; c++) {
        const ch = channels[c];
        for (let i = 0; i < n; i++) mono[i] += ch[i];
      }
      const scale = 1 / channels.length;
      for (let i = 0; i < n; i++) mono[i] *= scale;
    }
    this.resampler.process(mono, this.emit);
    return this.running;
  }
}

registerProcessor("pcm-worklet", PcmWorkletProcessor);

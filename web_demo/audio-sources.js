// Audio sources that produce 16 kHz mono Int16 frames: the microphone and a local file.

export const TARGET_RATE = 16000;
export const FRAME_MS = 40;
export const FRAME_SAMPLES = (TARGET_RATE * FRAME_MS) / 1000; // 640 samples per frame

/** An error whose message is meant for the page's user. */
export class SourceError extends Error {}

function microphoneError(err) {
  switch (err?.name) {
    case "NotAllowedError":
    case "SecurityError":
      return new SourceError(
        "Microphone access was denied. Allow the microphone for this site (the icon in the " +
          "address bar) and press Start again, or caption an audio file instead.",
      );
    case "NotFoundError":
    case "OverconstrainedError":
      return new SourceError("No microphone was found. Plug one in, or caption an audio file.");
    case "NotReadableError":
    case "AbortError":
      return new SourceError(
        "The microphone could not be opened (is another application using it?).",
      );
    default:
      return new SourceError(`The microphone could not be opened: ${err?.message ?? err}`);
  }
}

/**
 * Capture the microphone through the PCM worklet.
 * `onFrame(Int16Array)` receives 40 ms frames, `onLevel(rms)` a level per frame.
 * Resolves to {inputRate, stop}; `stop()` flushes the last partial frame, then releases
 * the device. Throws SourceError with a readable message when capture is impossible.
 */
export async function openMicrophone({ onFrame, onLevel }) {
  if (!window.isSecureContext || !navigator.mediaDevices?.getUserMedia) {
    throw new SourceError(
      "The microphone needs a secure context: open this page as http://localhost:PORT " +
        "(or 127.0.0.1) on the server's machine, or over https (start the server with " +
        "--certfile and --keyfile).",
    );
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({
      audio: {
        channelCount: { ideal: 1 },
        // Browser speech processing smears words; the recogniser prefers raw audio.
        echoCancellation: false,
        noiseSuppression: false,
        autoGainControl: false,
      },
    });
  } catch (err) {
    throw microphoneError(err);
  }
  // The context runs at the device's native rate; the worklet resamples (see its header).
  const context = new AudioContext({ latencyHint: "interactive" });
  const workletUrl = new URL("pcm-worklet.js", import.meta.url);
  try {
    await context.audioWorklet.addModule(workletUrl);
  } catch (err) {
    stream.getTracks().forEach((t) => t.stop());
    await context.close();
    // The worklet's code comes from the server: when it cannot be fetched, the server is
    // the problem, not the browser.
    const reachable = await fetch(workletUrl, { method: "HEAD", cache: "no-store" }).then(
      (response) => response.ok,
      () => false,
    );
    if (!reachable) {
      throw new SourceError(
        "The server cannot be reached (it serves this page's audio code): " +
          "start it again, then press Start.",
      );
    }
    throw new SourceError(`This browser cannot run the audio worklet: ${err.message}`);
  }
  const source = context.createMediaStreamSource(stream);
  const node = new AudioWorkletNode(context, "pcm-worklet", {
    numberOfInputs: 1,
    numberOfOutputs: 1,
    outputChannelCount: [1],
    processorOptions: { targetRate: TARGET_RATE, frameSamples: FRAME_SAMPLES },
  });
  // A muted path to the destination keeps the graph pulled in every browser.
  const mute = new GainNode(context, { gain: 0 });
  source.connect(node).connect(mute).connect(context.destination);

  let flushed = null;
  node.port.onmessage = ({ data }) => {
    if (data.type === "frame") {
      onFrame(new Int16Array(data.pcm));
      onLevel?.(data.level);
    } else if (data.type === "flushed") {
      flushed?.();
    }
  };
  if (context.state === "suspended") await context.resume();

  const track = stream.getAudioTracks()[0];
  let stopped = false;
  return {
    inputRate: context.sampleRate,
    deviceLabel: track?.label ?? "",
    /** Resolves once the device is released and every captured sample was delivered. */
    async stop() {
      if (stopped) return;
      stopped = true;
      stream.getTracks().forEach((t) => t.stop());
      await new Promise((resolve) => {
        flushed = resolve;
        node.port.postMessage({ type: "flush" });
        setTimeout(resolve, 500); // a suspended context never answers
      });
      node.port.postMessage({ type: "close" });
      source.disconnect();
      node.disconnect();
      await context.close();
    },
  };
}

/** Decode an audio file to 16 kHz mono Int16 (the browser's decoder and resampler). */
export async function decodeFile(file) {
  const bytes = await file.arrayBuffer();
  // decodeAudioData resamples to the context's rate; an OfflineAudioContext may run at 16 kHz.
  const context = new OfflineAudioContext(1, 1, TARGET_RATE);
  let buffer;
  try {
    buffer = await context.decodeAudioData(bytes);
  } catch (err) {
    throw new SourceError(`"${file.name}" could not be decoded as audio (${err?.message ?? err}).`);
  }
  const n = buffer.length;
  const mono = new Float32Array(n);
  for (let c = 0; c < buffer.numberOfChannels; c++) {
    const ch = buffer.getChannelData(c);
    for (let i = 0; i < n; i++) mono[i] += ch[i];
  }
  const pcm = new Int16Array(n);
  const scale = 1 / buffer.numberOfChannels;
  for (let i = 0; i < n; i++) {
    const s = Math.max(-1, Math.min(1, mono[i] * scale));
    pcm[i] = s < 0 ? Math.round(s * 32768) : Math.round(s * 32767);
  }
  return pcm;
}

/**
 * Stream `pcm` (16 kHz Int16) in 40 ms frames at real-time pace, like a microphone would.
 * `onProgress(sentSamples, totalSamples)` after each frame. Resolves when everything was
 * handed to `onFrame`, or early (false) when `signal` aborts.
 */
export function playPcm(pcm, { onFrame, onLevel, onProgress, signal }) {
  return new Promise((resolve) => {
    const startedAt = performance.now();
    let sent = 0;
    let timer = null;
    const abort = () => {
      clearTimeout(timer);
      resolve(false);
    };
    signal?.addEventListener("abort", abort, { once: true });
    const tick = () => {
      // Catch up on whatever is due (timers are throttled in background tabs).
      const dueSamples = ((performance.now() - startedAt) / 1000) * TARGET_RATE + FRAME_SAMPLES;
      while (sent < pcm.length && sent < dueSamples) {
        const frame = pcm.slice(sent, Math.min(sent + FRAME_SAMPLES, pcm.length));
        sent += frame.length;
        onFrame(frame);
        if (onLevel) {
          let energy = 0;
          for (const s of frame) energy += (s / 32768) ** 2;
          onLevel(Math.sqrt(energy / frame.length));
        }
        onProgress?.(sent, pcm.length);
      }
      if (sent >= pcm.length) {
        signal?.removeEventListener("abort", abort);
        resolve(true);
        return;
      }
      const nextDueMs = ((sent - FRAME_SAMPLES) / TARGET_RATE) * 1000;
      timer = setTimeout(tick, Math.max(5, nextDueMs - (performance.now() - startedAt)));
    };
    tick();
  });
}

// AudioWorklet processors of the WebSocket fallback (they run on the audio thread).

// The mic, as float32 mono chunks of `chunk` samples at the context's rate.
class PcmCapture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.chunk = options.processorOptions?.chunk ?? 960;
    this.buffer = new Float32Array(this.chunk);
    this.fill = 0;
  }

  process(inputs) {
    const input = inputs[0]?.[0];
    let i = 0;
    while (input && i < input.length) {
      const n = Math.min(input.length - i, this.chunk - this.fill);
      this.buffer.set(input.subarray(i, i + n), this.fill);
      this.fill += n;
      i += n;
      if (this.fill === this.chunk) {
        this.port.postMessage(this.buffer.slice(0));
        this.fill = 0;
      }
    }
    return true;
  }
}

// The answer: queued chunks played in order. It reports how many samples of each item it has
// played (the page truncates the item at that point on barge-in), when playback starts, and
// when it runs dry. `clear` drops everything queued at once.
class PcmPlayer extends AudioWorkletProcessor {
  constructor() {
    super();
    this.queue = [];
    this.current = null;
    this.offset = 0;
    this.played = new Map();
    this.playing = false;
    this.sinceReport = 0;
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  onMessage(message) {
    if (message.type === "push") {
      this.queue.push({ itemId: message.itemId, samples: message.samples });
    } else if (message.type === "clear") {
      this.queue = [];
      this.current = null;
      this.playing = false;
      this.port.postMessage({ type: "cleared", played: Object.fromEntries(this.played) });
    }
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    let i = 0;
    while (i < out.length) {
      if (!this.current) {
        this.current = this.queue.shift() ?? null;
        this.offset = 0;
        if (!this.current) break;
        if (!this.playing) {
          this.playing = true;
          this.port.postMessage({ type: "started", itemId: this.current.itemId });
        }
      }
      const n = Math.min(out.length - i, this.current.samples.length - this.offset);
      out.set(this.current.samples.subarray(this.offset, this.offset + n), i);
      i += n;
      this.offset += n;
      const id = this.current.itemId;
      this.played.set(id, (this.played.get(id) ?? 0) + n);
      if (this.offset >= this.current.samples.length) this.current = null;
    }
    out.fill(0, i);
    while (this.played.size > 16) this.played.delete(this.played.keys().next().value);
    if (this.playing && !this.current && this.queue.length === 0) {
      this.playing = false;
      this.port.postMessage({ type: "drained", played: Object.fromEntries(this.played) });
    }
    this.sinceReport += out.length;
    if (this.sinceReport >= 1200) {
      this.sinceReport = 0;
      this.port.postMessage({ type: "played", played: Object.fromEntries(this.played) });
    }
    return true;
  }
}

registerProcessor("pcm-capture", PcmCapture);
registerProcessor("pcm-player", PcmPlayer);

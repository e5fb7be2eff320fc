// WebSocket fallback: the same protocol with audio inside the events. The mic is captured by
// an AudioWorklet at 24 kHz and sent as PCM16 `input_audio_buffer.append`; answer deltas are
// played by another worklet that counts what it played, so on barge-in the page clears its
// playback and truncates the item at what was actually heard.

const RATE = 24000;
const CHUNK = 960; // 40 ms per append
const OPEN_TIMEOUT_MS = 10000;

function encodePcm16(float32) {
  const pcm = new Int16Array(float32.length);
  for (let i = 0; i < float32.length; i++) {
    const s = Math.max(-1, Math.min(1, float32[i]));
    pcm[i] = s < 0 ? s * 32768 : s * 32767;
  }
  const bytes = new Uint8Array(pcm.buffer);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

function decodePcm16(base64) {
  const binary = atob(base64);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  const pcm = new Int16Array(bytes.buffer, 0, bytes.length >> 1);
  const out = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) out[i] = pcm[i] / 32768;
  return out;
}

function opened(ws) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error("WebSocket connection timed out")), OPEN_TIMEOUT_MS);
    ws.addEventListener("open", () => { clearTimeout(timer); resolve(); }, { once: true });
    ws.addEventListener("close", (e) => {
      clearTimeout(timer);
      reject(new Error(`WebSocket closed (${e.code}) ${e.reason}`));
    }, { once: true });
  });
}

export async function connectWebSocket({ key, model, micStream, onEvent, onRemoteStream, onPlayback, onClosed }) {
  const scheme = window.location.protocol === "https:" ? "wss" : "ws";
  const protocols = ["realtime"];
  if (key) protocols.push(`openai-insecure-api-key.${key}`);
  // omni_extensions=1: the page understands our `omni.*` events (resume data); stock clients don't ask.
  const url = `${scheme}://${window.location.host}/v1/realtime?model=${encodeURIComponent(model)}&omni_extensions=1`;
  const ws = new WebSocket(url, protocols);
  await opened(ws);

  const ctx = new AudioContext({ sampleRate: RATE });
  await ctx.audioWorklet.addModule("/static/worklets.js");
  const capture = new AudioWorkletNode(ctx, "pcm-capture", { processorOptions: { chunk: CHUNK } });
  const mute = ctx.createGain();
  mute.gain.value = 0; // keeps the capture node pulled without playing the mic back
  ctx.createMediaStreamSource(micStream).connect(capture).connect(mute).connect(ctx.destination);
  const player = new AudioWorkletNode(ctx, "pcm-player", { numberOfInputs: 0, outputChannelCount: [1] });
  player.connect(ctx.destination);
  const answer = ctx.createMediaStreamDestination();
  player.connect(answer);
  onRemoteStream(answer.stream);

  const pushed = new Map(); // item id → samples received
  let played = {}; // item id → samples played (from the player)
  let playingItem = null;
  let audioBytes = 0;
  let onCleared = null;

  capture.port.onmessage = (e) => {
    if (ws.readyState === WebSocket.OPEN) {
      ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: encodePcm16(e.data) }));
    }
  };
  player.port.onmessage = (e) => {
    const m = e.data;
    if (m.played) played = m.played;
    if (m.type === "started") {
      playingItem = m.itemId;
      onPlayback?.("started", m.itemId);
    } else if (m.type === "drained") {
      onPlayback?.("drained", playingItem);
    } else if (m.type === "cleared") {
      onCleared?.();
    }
  };
  ws.addEventListener("message", (e) => {
    const event = JSON.parse(e.data);
    if (event.type === "response.output_audio.delta") {
      const samples = decodePcm16(event.delta);
      audioBytes += samples.length * 2;
      pushed.set(event.item_id, (pushed.get(event.item_id) ?? 0) + samples.length);
      player.port.postMessage({ type: "push", itemId: event.item_id, samples }, [samples.buffer]);
    }
    onEvent(event);
  });
  ws.addEventListener("close", (e) => onClosed?.(`WebSocket closed (${e.code})`));

  const send = (event) => ws.send(JSON.stringify(event));
  return {
    kind: "websocket",
    send,
    async close() {
      ws.close(1000);
      await ctx.close().catch(() => {});
    },
    // Barge-in: stop playback now and truncate the item at what was heard.
    onSpeechStarted() {
      const item = playingItem;
      onCleared = () => {
        onCleared = null;
        const heard = played[item] ?? 0;
        if (item && heard < (pushed.get(item) ?? 0)) {
          send({
            type: "conversation.item.truncate",
            item_id: item,
            content_index: 0,
            audio_end_ms: Math.floor((heard * 1000) / RATE),
          });
        }
        playingItem = null;
      };
      player.port.postMessage({ type: "clear" });
    },
    async inboundAudioBytes() {
      return audioBytes;
    },
  };
}

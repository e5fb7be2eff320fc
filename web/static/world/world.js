// World-model demo client for /v1/realtime/video.
// WebSocket: each video.chunk_metadata is followed by one binary frame holding the chunk's
// JPEGs back to back (frame_byte_lengths says where each ends); frames are drawn 1/fps apart.
// WebRTC: POST an SDP offer to /v1/realtime/video/calls; frames arrive on the video track and
// the same JSON events travel on the "controls" data channel (chunk metadata = status).

const params = new URLSearchParams(location.search);
const DEBUG = params.has("debug"); // record a pixel hash of the canvas per chunk (tests compare them)
const MOVE_KEYS = new Set(["w", "a", "s", "d", "arrowup", "arrowdown", "arrowleft", "arrowright"]);
const $ = (id) => document.getElementById(id);

const state = {
  ws: null,
  pc: null,                 // WebRTC: the peer connection and its controls channel
  channel: null,
  config: null,
  pendingMeta: null,        // metadata waiting for its binary frame
  playout: [],              // {bitmap, chunkIndex, due}
  framesDrawn: 0,
  lastChunk: -1,
  drawTimes: [],
  held: new Set(),
  waitingActions: new Map(), // event_id -> {sentAt, appliesAt}
  latencies: [],
  eventSeq: 0,
  decoding: Promise.resolve(),
  queued: {},               // event_id -> applies_at_chunk
  chunkHashes: {},          // DEBUG: chunk index -> hash of the canvas after its first frame
};
window.__world = state; // for tests and the curious

function log(line) {
  const el = $("log");
  el.textContent = `${new Date().toISOString().slice(11, 23)} ${line}\n` + el.textContent.slice(0, 4000);
}

function send(event) {
  if (state.ws && state.ws.readyState === WebSocket.OPEN) state.ws.send(JSON.stringify(event));
  if (state.channel && state.channel.readyState === "open") state.channel.send(JSON.stringify(event));
}

function startEvent(format) {
  const size = Number($("size").value) || 256;
  return {
    type: "session.start", model: $("model").value, format,
    width: size, height: size, fps: Number($("fps").value) || 30, seed: Number($("seed").value) || 0,
    prompt: $("prompt").value || "",
  };
}

function showVideo(on) {
  $("video").hidden = !on;
  $("screen").hidden = on;
}

async function startRtc() {
  const pc = new RTCPeerConnection({ iceServers: [] });
  state.pc = pc;
  pc.addTransceiver("video", { direction: "recvonly" });
  const channel = pc.createDataChannel("controls");
  state.channel = channel;
  channel.onopen = () => { send(startEvent("jpeg")); $("status").textContent = "starting"; };
  channel.onmessage = (msg) => onEvent(JSON.parse(msg.data));
  channel.onclose = () => { $("status").textContent = "closed"; $("stop").disabled = true; };
  pc.ontrack = (ev) => { $("video").srcObject = ev.streams[0] || new MediaStream([ev.track]); };
  await pc.setLocalDescription(await pc.createOffer());
  const response = await fetch("/v1/realtime/video/calls?omni_extensions=1", {
    method: "POST", body: pc.localDescription.sdp, headers: { "Content-Type": "application/sdp" },
  });
  if (response.status !== 201) {
    log(`call refused: ${await response.text()}`);
    return;
  }
  await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
  const video = $("video");
  const count = () => {
    state.framesDrawn += 1;
    state.drawTimes.push(performance.now());
    if (state.pc === pc) video.requestVideoFrameCallback(count);
  };
  video.requestVideoFrameCallback(count);
}

function start() {
  stop();
  $("stop").disabled = false;
  if ($("transport").value === "webrtc") {
    showVideo(true);
    $("video").focus();
    startRtc().catch((err) => log(`webrtc: ${err}`));
    return;
  }
  showVideo(false);
  const url = new URL("/v1/realtime/video?omni_extensions=1", location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  state.ws = ws;
  ws.onopen = () => {
    send(startEvent("jpeg"));
    $("status").textContent = "starting";
  };
  ws.onmessage = (msg) => (typeof msg.data === "string" ? onEvent(JSON.parse(msg.data)) : onBinary(msg.data));
  ws.onclose = (ev) => {
    $("status").textContent = `closed (${ev.code}${ev.reason ? ": " + ev.reason : ""})`;
    $("stop").disabled = true;
    $("send-prompt").disabled = true;
    if (state.ws === ws) state.ws = null;
  };
  $("screen").focus();
}

function stop() {
  if (state.ws) {
    send({ type: "session.stop" });
    state.ws.close(1000, "client stopped");
    state.ws = null;
  }
  if (state.pc) {
    send({ type: "session.stop" });
    state.pc.close();
    state.pc = null;
    state.channel = null;
  }
  state.playout = [];
  state.pendingMeta = null;
}

function onEvent(event) {
  switch (event.type) {
    case "video.start": {
      state.config = event.config;
      const canvas = $("screen");
      canvas.width = event.config.width;
      canvas.height = event.config.height;
      $("video").width = event.config.width;
      $("video").height = event.config.height;
      $("status").textContent = `streaming ${event.config.model}`;
      $("send-prompt").disabled = !event.config.prompt_updates;
      log(`started ${event.request_id} ${JSON.stringify(event.config)}`);
      break;
    }
    case "video.chunk_metadata":
      if (event.kind === "rtp") {
        // WebRTC status: the chunk went onto the track (displayed a jitter buffer later)
        state.lastChunk = event.chunk_index;
        noteApplied(event.chunk_index, performance.now());
      } else {
        state.pendingMeta = event;
      }
      break;
    case "session.interaction.queued": {
      state.queued[event.event_id] = event.applies_at_chunk;
      const waiting = state.waitingActions.get(event.event_id);
      if (waiting) waiting.appliesAt = event.applies_at_chunk;
      break;
    }
    case "session.interaction.applied":
      break;
    case "session.done":
      $("status").textContent = `done (${event.reason}, ${event.frames} frames)`;
      break;
    case "error":
      log(`error ${event.code}: ${event.message}`);
      break;
    default:
      break;
  }
}

function onBinary(buffer) {
  const meta = state.pendingMeta;
  state.pendingMeta = null;
  if (!meta || meta.format !== "jpeg") return;
  // decode in arrival order, one chunk after the other
  state.decoding = state.decoding.then(() => enqueueChunk(meta, buffer)).catch((err) => log(`decode: ${err}`));
}

async function enqueueChunk(meta, buffer) {
  const lengths = meta.frame_byte_lengths || [buffer.byteLength];
  const frameMs = 1000 / meta.fps;
  let offset = 0;
  const decoded = lengths.map((len) => {
    const blob = new Blob([buffer.slice(offset, offset + len)], { type: "image/jpeg" });
    offset += len;
    return createImageBitmap(blob);
  });
  const bitmaps = await Promise.all(decoded);
  const now = performance.now();
  // Play right after what is queued, but never let the queue grow past one chunk behind.
  const tail = state.playout.length ? state.playout[state.playout.length - 1].due + frameMs : now;
  let due = Math.max(now, Math.min(tail, now + frameMs * lengths.length));
  bitmaps.forEach((bitmap, i) => {
    state.playout.push({ bitmap, chunkIndex: meta.chunk_index, first: i === 0, due });
    due += frameMs;
  });
}

function render() {
  const now = performance.now();
  const ctx = $("screen").getContext("2d");
  while (state.playout.length && state.playout[0].due <= now) {
    const frame = state.playout.shift();
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(frame.bitmap, 0, 0, ctx.canvas.width, ctx.canvas.height);
    frame.bitmap.close();
    state.framesDrawn += 1;
    state.lastChunk = frame.chunkIndex;
    state.drawTimes.push(now);
    if (frame.first) {
      noteApplied(frame.chunkIndex, now);
      if (DEBUG) state.chunkHashes[frame.chunkIndex] = canvasHash(ctx);
    }
  }
  while (state.drawTimes.length && state.drawTimes[0] < now - 1000) state.drawTimes.shift();
  $("fps-out").textContent = state.drawTimes.length;
  $("chunk").textContent = state.lastChunk >= 0 ? state.lastChunk : "–";
  requestAnimationFrame(render);
}

function canvasHash(ctx) {
  const data = ctx.getImageData(0, 0, ctx.canvas.width, ctx.canvas.height).data;
  let h = 0x811c9dc5;
  for (let i = 0; i < data.length; i++) {
    h ^= data[i];
    h = Math.imul(h, 0x01000193);
  }
  return (h >>> 0).toString(16);
}

function noteApplied(chunkIndex, now) {
  for (const [id, waiting] of state.waitingActions) {
    if (waiting.appliesAt !== undefined && chunkIndex >= waiting.appliesAt) {
      const latency = now - waiting.sentAt;
      state.latencies.push(latency);
      $("latency").textContent = latency.toFixed(0);
      state.waitingActions.delete(id);
    }
  }
}

function keyEvent(kind, ev) {
  const key = ev.key.toLowerCase();
  if (!MOVE_KEYS.has(key) || ev.target === $("prompt")) return;
  ev.preventDefault();
  if (ev.repeat) return; // the server coalesces repeats anyway; no need to send them
  if (kind === "keydown") state.held.add(key); else state.held.delete(key);
  $("keys").textContent = state.held.size ? [...state.held].join(" ") : "–";
  const eventId = `key_${++state.eventSeq}`;
  if (kind === "keydown") state.waitingActions.set(eventId, { sentAt: performance.now() });
  send({ type: "session.interaction", event_id: eventId, actions: [{ event: kind, key: ev.key, t_ms: performance.now() }] });
}

document.addEventListener("keydown", (ev) => keyEvent("keydown", ev));
document.addEventListener("keyup", (ev) => keyEvent("keyup", ev));
$("start").addEventListener("click", start);
$("stop").addEventListener("click", stop);
$("send-prompt").addEventListener("click", () => {
  send({ type: "session.interaction", event_id: `prompt_${++state.eventSeq}`, prompt: $("prompt").value });
});
requestAnimationFrame(render);
for (const name of ["model", "size", "fps", "seed", "prompt", "transport"]) {
  if (params.has(name)) $(name).value = params.get(name);
}
if (params.has("autostart")) start();

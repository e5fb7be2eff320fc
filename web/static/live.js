// GPT-Live transport (POST /v1/live/sessions, duplex pipelines): the mic on an audio track, the
// model's continuous stream on the remote track, and the GPT-Live events on the `oai-events`
// data channel. The first event is session.start; the model decides by itself when to speak.

const GATHER_TIMEOUT_MS = 3000;
const OPEN_TIMEOUT_MS = 10000;
const CLOSE_WAIT_MS = 2000;

function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} timed out after ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

function gatheringComplete(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const check = () => {
      if (pc.iceGatheringState === "complete") {
        pc.removeEventListener("icegatheringstatechange", check);
        resolve();
      }
    };
    pc.addEventListener("icegatheringstatechange", check);
  });
}

export async function connectLive({ key, model, iceServers, micStream, onEvent, onRemoteStream, onClosed }) {
  if (typeof RTCPeerConnection === "undefined") throw new Error("WebRTC is not available in this browser");
  const pc = new RTCPeerConnection({ iceServers: iceServers ?? [] });
  const channel = pc.createDataChannel("oai-events");
  for (const track of micStream.getAudioTracks()) pc.addTrack(track, micStream);
  pc.addEventListener("track", (e) => onRemoteStream(e.streams[0] ?? new MediaStream([e.track])));
  let closedEvent = null;
  const sessionClosed = new Promise((resolve) => (closedEvent = resolve));
  channel.addEventListener("message", (e) => {
    const event = JSON.parse(e.data);
    if (event.type === "session.closed") closedEvent();
    onEvent(event);
  });
  const opened = new Promise((resolve, reject) => {
    channel.addEventListener("open", resolve, { once: true });
    channel.addEventListener("close", () => reject(new Error("the events channel closed")), { once: true });
  });
  const auth = key ? { Authorization: `Bearer ${key}` } : {};
  let closed = false;
  const close = async () => {
    if (closed) return;
    closed = true;
    if (channel.readyState === "open") {
      channel.send(JSON.stringify({ type: "session.close" }));
      await withTimeout(sessionClosed, CLOSE_WAIT_MS, "session.closed").catch(() => {});
    }
    pc.close();
  };
  try {
    await pc.setLocalDescription(await pc.createOffer());
    await withTimeout(gatheringComplete(pc), GATHER_TIMEOUT_MS, "ICE gathering").catch(() => {});
    const resp = await fetch("/v1/live/sessions", {
      method: "POST",
      body: pc.localDescription.sdp,
      headers: { ...auth, "Content-Type": "application/sdp" },
    });
    if (resp.status !== 201) {
      const body = await resp.json().catch(() => ({}));
      throw new Error(`session refused (${resp.status}): ${body?.error?.message ?? resp.statusText}`);
    }
    await pc.setRemoteDescription({ type: "answer", sdp: await resp.text() });
    await withTimeout(opened, OPEN_TIMEOUT_MS, "WebRTC connection");
  } catch (err) {
    await close();
    throw err;
  }
  pc.addEventListener("connectionstatechange", () => {
    if (["failed", "closed"].includes(pc.connectionState)) onClosed?.(`connection ${pc.connectionState}`);
  });
  channel.addEventListener("close", () => onClosed?.("events channel closed"));
  const send = (event) => channel.send(JSON.stringify(event));
  send({
    type: "session.start",
    session: {
      model,
      audio: { format: { type: "audio/pcm", rate: 24000 }, output: { voice: "marin" } },
      delegation: { type: "client" },
    },
  });
  return {
    kind: "webrtc",
    pc,
    send,
    close,
    onSpeechStarted: () => {},
    async inboundAudioBytes() {
      let bytes = 0;
      (await pc.getStats()).forEach((report) => {
        if (report.type === "inbound-rtp" && report.kind === "audio") bytes += report.bytesReceived ?? 0;
      });
      return bytes;
    },
  };
}

// A WebRTC call to the server, for the Realtime and the GPT-Live transports alike: the mic on an
// audio track, the answer on the remote track, and every event on the `oai-events` data channel.

const GATHER_TIMEOUT_MS = 3000;
const OPEN_TIMEOUT_MS = 10000;

export function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} timed out after ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

// The server does not take trickled candidates: send the offer once gathering is done.
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

// POST the offer to `url`; `refused` names a refusal in errors. `beforeClose(channel)` runs
// while the channel may still be open (a goodbye event); with `hangup`, closing also POSTs to
// the call's Location + "/hangup". Returns the open call: { pc, send, close, inboundAudioBytes }.
export async function openCall(url, { key, iceServers, micStream, onEvent, onRemoteStream, onClosed },
  { refused, beforeClose, hangup = false }) {
  if (typeof RTCPeerConnection === "undefined") throw new Error("WebRTC is not available in this browser");
  const pc = new RTCPeerConnection({ iceServers: iceServers ?? [] });
  const channel = pc.createDataChannel("oai-events");
  for (const track of micStream.getAudioTracks()) pc.addTrack(track, micStream);
  pc.addEventListener("track", (e) => onRemoteStream(e.streams[0] ?? new MediaStream([e.track])));
  channel.addEventListener("message", (e) => onEvent(JSON.parse(e.data)));
  const opened = new Promise((resolve, reject) => {
    channel.addEventListener("open", resolve, { once: true });
    channel.addEventListener("close", () => reject(new Error("the events channel closed")), { once: true });
  });
  const auth = key ? { Authorization: `Bearer ${key}` } : {};
  let callUrl = null; // the call's Location, for the hangup
  let closed = false;
  const close = async () => {
    if (closed) return;
    closed = true;
    if (beforeClose && channel.readyState === "open") await beforeClose(channel);
    pc.close();
    if (hangup && callUrl) await fetch(`${callUrl}/hangup`, { method: "POST", headers: auth }).catch(() => {});
  };
  try {
    await pc.setLocalDescription(await pc.createOffer());
    await withTimeout(gatheringComplete(pc), GATHER_TIMEOUT_MS, "ICE gathering").catch(() => {});
    const resp = await fetch(url, {
      method: "POST",
      body: pc.localDescription.sdp,
      headers: { ...auth, "Content-Type": "application/sdp" },
    });
    if (resp.status !== 201) {
      const body = await resp.json().catch(() => ({}));
      throw new Error(`${refused} (${resp.status}): ${body?.error?.message ?? resp.statusText}`);
    }
    callUrl = resp.headers.get("Location");
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
  return {
    pc,
    send: (event) => channel.send(JSON.stringify(event)),
    close,
    async inboundAudioBytes() {
      let bytes = 0;
      (await pc.getStats()).forEach((report) => {
        if (report.type === "inbound-rtp" && report.kind === "audio") bytes += report.bytesReceived ?? 0;
      });
      return bytes;
    },
  };
}

// WebRTC transport: a call (peer.js) to POST /v1/realtime/calls, OpenAI-compatible. The
// server tracks what it has played, so barge-in needs nothing from the page.

import { openCall } from "./peer.js";

export async function connectWebRTC({ model, ...options }) {
  const url = `/v1/realtime/calls?model=${encodeURIComponent(model)}&omni_extensions=1`;
  const call = await openCall(url, options, { refused: "call rejected", hangup: true });
  // Barge-in and truncation happen on the server, which knows what it played.
  return { kind: "webrtc", ...call, onSpeechStarted: () => {} };
}

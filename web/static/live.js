// GPT-Live transport (POST /v1/live/sessions, duplex pipelines): a call (peer.js) whose remote
// track is the model's continuous stream and whose channel carries the GPT-Live events. The
// first event is session.start; the model decides by itself when to speak.

import { openCall, withTimeout } from "./peer.js";

const CLOSE_WAIT_MS = 2000;

export async function connectLive({ model, onEvent, ...options }) {
  let closedEvent = null;
  const sessionClosed = new Promise((resolve) => (closedEvent = resolve));
  const seen = (event) => {
    if (event.type === "session.closed") closedEvent();
    onEvent(event);
  };
  const goodbye = async (channel) => {
    channel.send(JSON.stringify({ type: "session.close" }));
    await withTimeout(sessionClosed, CLOSE_WAIT_MS, "session.closed").catch(() => {});
  };
  const call = await openCall("/v1/live/sessions", { ...options, onEvent: seen }, {
    refused: "session refused",
    beforeClose: goodbye,
  });
  call.send({
    type: "session.start",
    session: {
      model,
      audio: { format: { type: "audio/pcm", rate: 24000 }, output: { voice: "marin" } },
      delegation: { type: "client" },
    },
  });
  return { kind: "webrtc", ...call, onSpeechStarted: () => {} };
}

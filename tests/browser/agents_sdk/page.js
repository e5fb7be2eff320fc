// The official browser SDK (@openai/agents-realtime) as a web app uses it, driven by
// tests/browser/test_agents_sdk.py through `window.agentsTest`. Bundled by esbuild into
// dist/page.js (`make browser-sdk`); page.html loads it.
import { OpenAIRealtimeWebRTC, RealtimeAgent, RealtimeSession, tool } from '@openai/agents-realtime';
import { z } from 'zod';

const seen = {
  events: [], // the type of every server event the SDK received
  errors: [], // what the SDK's `error` event handed the application
  history: [], // the SDK's history: {type, role, text} per item
  toolCalls: [], // the arguments each run of the tool got
  sessionUpdated: null, // the last `session.updated` session, as the server sent it
  turnsEnded: 0,
  callId: null,
};
let session = null;

const getWeather = tool({
  name: 'get_weather',
  description: "Today's weather in a city.",
  parameters: z.object({ city: z.string() }),
  async execute({ city }) {
    seen.toolCalls.push({ city });
    return `It is sunny in ${city}.`;
  },
});

function describe(error) {
  if (error instanceof Error) return `${error.name}: ${error.message}`;
  try {
    return JSON.stringify(error);
  } catch {
    return String(error);
  }
}

function textOf(item) {
  if (item.type !== 'message') return '';
  return (item.content || []).map((part) => part.transcript || part.text || '').join('');
}

/** Connect a session: `withTool` gives the agent the `get_weather` function tool; `config`
 * is the SDK's session config (camelCase, as an app writes it). */
async function connect({ baseUrl, apiKey, withTool = false, config = {} }) {
  const agent = new RealtimeAgent({
    name: 'assistant',
    instructions: withTool ? 'Use tools when asked.' : 'Answer briefly.',
    tools: withTool ? [getWeather] : [],
  });
  const transport = new OpenAIRealtimeWebRTC({ baseUrl });
  session = new RealtimeSession(agent, { transport, model: 'gpt-realtime', config });
  session.on('error', (event) => seen.errors.push(describe(event.error)));
  session.on('transport_event', (event) => {
    seen.events.push(event.type);
    if (event.type === 'session.updated') seen.sessionUpdated = event.session;
  });
  session.on('history_updated', (history) => {
    seen.history = history.map((item) => ({ type: item.type, role: item.role, text: textOf(item) }));
  });
  session.on('agent_end', () => {
    seen.turnsEnded += 1;
  });
  try {
    await session.connect({ apiKey });
  } catch (error) {
    return { ok: false, error: describe(error) };
  }
  seen.callId = transport.callId ?? null;
  return { ok: true, callId: seen.callId };
}

/** Bytes of answer audio the browser received on the call (its own WebRTC stats). */
async function inboundAudioBytes() {
  const pc = session?.transport?.connectionState?.peerConnection;
  if (!pc) return 0;
  let bytes = 0;
  (await pc.getStats()).forEach((report) => {
    if (report.type === 'inbound-rtp' && report.kind === 'audio') bytes += report.bytesReceived;
  });
  return bytes;
}

window.agentsTest = {
  seen,
  connect,
  sendText: (text) => session.sendMessage(text),
  inboundAudioBytes,
  close: () => session?.close(),
};

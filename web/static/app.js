// The voice chat page: connect, show both sides' transcripts, the turn state and per-turn
// latency. Transport: WebRTC (rtc.js) when available, else the WebSocket fallback (ws.js).
// `window.demo` mirrors what the page shows, for people poking at it and for the browser test.

import { connectLive } from "./live.js";
import { connectWebRTC } from "./rtc.js";
import { connectWebSocket } from "./ws.js";

const $ = (id) => document.getElementById(id);
const METER_MS = 20;
const MIC_VOICE_RMS = 0.015; // the mic is "voiced" above this (after echo cancellation)
const ANSWER_RMS = 0.005; // the answer is audible above this
const FALLBACK_AUDIO_MS = 1500; // no onset seen on the answer meter: use the started event
const LIVE_PAUSE_MS = 800; // GPT-Live: a pause this long on the model's timeline ends its message

const demo = {
  state: "idle",
  protocol: "realtime", // or "live": GPT-Live on a duplex pipeline (live.js)
  transport: null,
  turnDetection: null, // the session's turn_detection type, as the server last said
  userTranscripts: [],
  assistantTranscripts: [],
  latencies: [],
  errors: [],
  events: [],
  async inboundAudioBytes() {
    return call?.transport ? call.transport.inboundAudioBytes() : 0;
  },
};
window.demo = demo;

let call = null; // { transport, micStream, audio, meters, timer }
let silenceMs = 500;
let turn = null; // the turn awaiting its first audio
let lastVoiceAt = 0;
let speechStartedAt = 0;
const bubbles = new Map();
const live = { count: 0, output: null, input: null }; // GPT-Live: the message each side is in

// --- view ------------------------------------------------------------------------------------

function setState(state) {
  demo.state = state;
  const el = $("state");
  el.textContent = state;
  el.className = `state ${state}`;
  el.dataset.state = state;
}

function showError(message) {
  demo.errors.push(message);
  $("error").textContent = message;
}

function bubble(itemId, role) {
  let el = bubbles.get(itemId);
  if (!el) {
    el = document.createElement("div");
    el.className = `msg ${role} pending`;
    el.dataset.itemId = itemId;
    el.dataset.role = role;
    el.append(document.createElement("span"));
    $("transcript").append(el);
    bubbles.set(itemId, el);
    el.scrollIntoView({ block: "end" });
  }
  return el;
}

function setText(itemId, role, text, { append = false, final = false } = {}) {
  const el = bubble(itemId, role);
  const span = el.firstChild;
  span.textContent = append ? span.textContent + text : text;
  if (final) el.classList.remove("pending");
}

function markInterrupted(itemId) {
  const el = bubbles.get(itemId);
  if (el && !el.querySelector(".badge")) {
    const badge = document.createElement("span");
    badge.className = "badge";
    badge.textContent = "interrupted";
    el.append(badge);
  }
}

function recordLatency(at, how) {
  if (!turn || turn.firstAudioAt) return;
  turn.firstAudioAt = at;
  const ms = Math.max(0, Math.round(at - turn.endOfSpeech));
  demo.latencies.push(ms);
  $("latency").textContent = `${ms} ms`;
  const li = document.createElement("li");
  li.textContent = `${ms} ms (end of speech: ${turn.how}; first audio: ${how})`;
  $("latencies").append(li);
  setState("speaking");
}

// --- events ----------------------------------------------------------------------------------

// GPT-Live has no items: a side's transcript deltas form one message until a pause on the
// model's timeline (start_ms past the last end_ms), as LiveKit's plugin groups them.
function liveTranscript(event, role, key, transcripts) {
  let current = live[key];
  if (!current || event.start_ms - current.end > LIVE_PAUSE_MS) {
    if (current) setText(current.id, role, current.text, { final: true });
    current = live[key] = { id: `live_${live.count++}`, text: "", end: 0, index: transcripts.length };
    transcripts.push("");
  }
  current.text += event.delta;
  current.end = event.end_ms;
  transcripts[current.index] = current.text;
  setText(current.id, role, event.delta, { append: true });
}

function onEvent(event) {
  const now = performance.now();
  demo.events.push([Math.round(now), event.type]);
  switch (event.type) {
    case "session.started":
      if (demo.state === "connecting") setState("listening");
      break;
    case "session.output_transcript.delta":
      liveTranscript(event, "assistant", "output", demo.assistantTranscripts);
      break;
    case "session.input_transcript.delta":
      liveTranscript(event, "user", "input", demo.userTranscripts);
      break;
    case "session.closed":
      setState("idle");
      break;
    case "session.created":
    case "session.updated": {
      const td = event.session?.audio?.input?.turn_detection;
      if (td?.silence_duration_ms) silenceMs = td.silence_duration_ms;
      demo.turnDetection = td?.type ?? null;
      if (demo.state === "connecting") setState("listening");
      break;
    }
    case "input_audio_buffer.speech_started":
      speechStartedAt = now;
      call?.transport?.onSpeechStarted();
      turn = null;
      setState("listening");
      setText(event.item_id, "user", "…");
      break;
    case "input_audio_buffer.speech_stopped": {
      // End of speech: the mic meter's last voiced moment, or the server's VAD minus its silence.
      const metered = lastVoiceAt > speechStartedAt && lastVoiceAt <= now;
      turn = {
        endOfSpeech: metered ? lastVoiceAt : now - silenceMs,
        how: metered ? "mic meter" : "server VAD",
        firstAudioAt: null,
        startedEventAt: null,
      };
      setState("thinking");
      break;
    }
    case "conversation.item.input_audio_transcription.delta":
      setText(event.item_id, "user", event.delta, { append: bubble(event.item_id, "user").textContent !== "…" });
      break;
    case "conversation.item.input_audio_transcription.completed":
      setText(event.item_id, "user", event.transcript, { final: true });
      demo.userTranscripts.push(event.transcript);
      break;
    case "conversation.item.input_audio_transcription.failed":
      setText(event.item_id, "user", "(could not transcribe)", { final: true });
      break;
    case "response.created":
      setState("thinking");
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      setText(event.item_id, "assistant", event.delta, { append: true });
      break;
    case "response.output_audio_transcript.done":
      setText(event.item_id, "assistant", event.transcript, { final: true });
      demo.assistantTranscripts.push(event.transcript);
      break;
    case "response.output_text.done":
      setText(event.item_id, "assistant", event.text, { final: true });
      demo.assistantTranscripts.push(event.text);
      break;
    case "output_audio_buffer.started":
      if (turn) turn.startedEventAt = now;
      else setState("speaking");
      break;
    case "output_audio_buffer.stopped":
    case "output_audio_buffer.cleared":
      if (demo.state === "speaking" || demo.state === "thinking") setState("listening");
      break;
    case "conversation.item.truncated":
      markInterrupted(event.item_id);
      break;
    case "response.done":
      if (event.response.status === "failed") showError(`response failed: ${JSON.stringify(event.response.status_details)}`);
      if (!event.response.output?.some((item) => item.content?.some((c) => c.type === "output_audio"))) {
        if (demo.state === "thinking") setState("listening");
      }
      break;
    case "error":
      showError(`${event.error.code ?? event.error.type}: ${event.error.message}`);
      break;
    default:
      break;
  }
}

// WebSocket playback reports exactly when the answer starts and runs dry.
function onPlayback(what) {
  if (what === "started") {
    recordLatency(performance.now(), "playback start");
    setState("speaking");
  } else if (what === "drained" && demo.state === "speaking") setState("listening");
}

// --- meters ----------------------------------------------------------------------------------

function analyser(audio, stream) {
  const node = audio.createAnalyser();
  node.fftSize = 1024;
  audio.createMediaStreamSource(stream).connect(node);
  return node;
}

function rms(node, buffer) {
  node.getFloatTimeDomainData(buffer);
  let sum = 0;
  for (const x of buffer) sum += x * x;
  return Math.sqrt(sum / buffer.length);
}

function startMeters() {
  const buffer = new Float32Array(1024);
  return setInterval(() => {
    const now = performance.now();
    if (call.meters.mic) {
      const level = rms(call.meters.mic, buffer);
      $("mic-level").value = Math.min(1, level * 5);
      if (level > MIC_VOICE_RMS) lastVoiceAt = now;
    }
    if (call.meters.answer) {
      const level = rms(call.meters.answer, buffer);
      $("answer-level").value = Math.min(1, level * 5);
      if (turn && level > ANSWER_RMS) recordLatency(now, "answer meter");
    }
    if (turn && !turn.firstAudioAt && turn.startedEventAt && now - turn.startedEventAt > FALLBACK_AUDIO_MS) {
      recordLatency(turn.startedEventAt, "started event");
    }
  }, METER_MS);
}

// --- connect / hang up -----------------------------------------------------------------------

async function connect() {
  $("connect").disabled = true;
  $("error").textContent = "";
  setState("connecting");
  try {
    const key = $("key").value.trim();
    const resp = await fetch("/v1/demo/session", {
      method: "POST",
      headers: key ? { Authorization: `Bearer ${key}` } : {},
    });
    const secret = await resp.json();
    if (!resp.ok) throw new Error(secret?.error?.message ?? `demo session: ${resp.status}`);
    const micStream = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true, channelCount: 1 },
    });
    const audio = new AudioContext();
    call = { transport: null, micStream, audio, meters: { mic: analyser(audio, micStream), answer: null } };
    const options = {
      key: secret.value,
      model: secret.model,
      iceServers: secret.ice_servers,
      micStream,
      onEvent,
      onPlayback,
      onRemoteStream: (stream) => {
        if (!call) return;
        // Chrome only feeds a remote WebRTC stream to Web Audio while a media element plays it.
        // (The WebSocket fallback plays through its own worklet instead.)
        if (demo.transport === "webrtc") $("remote-audio").srcObject = stream;
        call.meters.answer = analyser(audio, stream);
      },
      onClosed: (why) => {
        if (call) {
          showError(`disconnected: ${why}`);
          hangup();
        }
      },
    };
    const choice = new URLSearchParams(window.location.search).get("transport") ?? $("transport").value;
    demo.protocol = $("protocol").value;
    if (demo.protocol === "live") {
      demo.transport = "webrtc"; // GPT-Live in the browser: WebRTC only
      call.transport = await connectLive(options);
    } else if (choice !== "websocket") {
      try {
        demo.transport = "webrtc";
        call.transport = await connectWebRTC(options);
      } catch (err) {
        if (choice === "webrtc") throw err;
        console.warn("WebRTC failed, falling back to WebSocket:", err);
      }
    }
    if (!call.transport) {
      demo.transport = "websocket";
      $("remote-audio").srcObject = null;
      call.transport = await connectWebSocket(options);
    }
    $("transport-used").textContent = demo.protocol === "live" ? "webrtc (GPT-Live)" : demo.transport;
    call.timer = startMeters();
    $("hangup").disabled = false;
    if (demo.protocol === "live") return; // session.start is sent; nothing to configure
    call.transport.send({
      type: "session.update",
      session: {
        type: "realtime",
        audio: {
          input: {
            transcription: { model: "whisper-1" },
            turn_detection: turnDetection(),
          },
        },
      },
    });
    $("hangup").disabled = false;
  } catch (err) {
    showError(String(err?.message ?? err));
    await hangup();
  }
}

// Server VAD ends a turn after a fixed silence; semantic_vad asks the server's end-of-turn
// model at each pause (a finished sentence is answered at once, one cut off mid-clause waits).
function turnDetection() {
  const params = new URLSearchParams(window.location.search);
  const type = params.get("turn_detection") ?? $("turn-detection").value;
  const common = { create_response: true, interrupt_response: true };
  if (type === "semantic_vad") {
    silenceMs = 200; // the turn ends ~200 ms into a pause the model calls finished
    return { type, eagerness: params.get("eagerness") ?? "auto", ...common };
  }
  return { type: "server_vad", ...common };
}

async function hangup() {
  const current = call;
  call = null;
  turn = null;
  live.output = live.input = null;
  $("hangup").disabled = true;
  $("connect").disabled = false;
  setState("idle");
  if (!current) return;
  clearInterval(current.timer);
  await current.transport?.close();
  current.micStream.getTracks().forEach((t) => t.stop());
  await current.audio.close().catch(() => {});
}

$("connect").addEventListener("click", connect);
$("hangup").addEventListener("click", hangup);
const params = new URLSearchParams(window.location.search);
if (params.get("transport")) $("transport").value = params.get("transport");
if (params.get("protocol")) $("protocol").value = params.get("protocol");
if (params.get("key")) $("key").value = params.get("key");

"""The Markdown summary of a results file: what ran, per-level tables, ratios, SLO verdicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path | None, doc: Any, **dumps: Any) -> None:
    """A benchmark's figures as JSON at ``path`` (its ``--json`` / ``--out``), when one was given."""
    if path is not None:
        path.write_text(json.dumps(doc, indent=2, **dumps) + "\n")


def publish(summary: str, doc: Any, path: Path | None) -> None:
    """A benchmark's summary on stdout, and its figures as JSON at ``path`` when given."""
    print(summary)
    write_json(path, doc)


def _f(value: Any, digits: int = 0, unit: str = "") -> str:
    if value is None:
        return "–"
    text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    return text + unit


def _codes(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "0"


def _admissions(summary: dict[str, Any]) -> str:
    """The "admitted / refused" cell (every outcome but ``admitted`` is a refusal)."""
    adm = summary.get("admissions", {})
    refused = sum(n for k, n in adm.items() if k != "admitted")
    return f"{adm.get('admitted', 0)} / {refused}"


LEVEL_HEADER = (
    "| config | N | turns | TTFA p50 | TTFA p95 | TTFA p99 | first→last p50 | RTF p50 | delta gap p99 / max "
    "| underruns | barge-in stop p50 | errors | admitted / refused |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n"
)
SERVER_HEADER = (
    "| config | N | server CPU mean / max | CPU ms per session-s "
    "| RSS idle → peak (growth; conversation audio; held audio) | loop lag p99 "
    "| server TTFA p50 / p95 | client CPU / loop lag p99 | late client sends "
    "| host CPU (all processes) / load avg |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
)


def level_row(lv: dict[str, Any]) -> str:
    s = lv["summary"]
    ttfa, gap = s["ttfa_ms"], s["delta_gap_ms"]
    silent = f" ({s['silent_frames']} silent frames)" if s.get("silent_frames") else ""
    return (
        f"| {lv['label']} | {lv['sessions']} | {s['turns']} | {_f(ttfa['p50'])} | {_f(ttfa['p95'])} "
        f"| {_f(ttfa['p99'])} | {_f(s['stream_ms']['p50'])} | {_f(s['rtf']['p50'], 2)} "
        f"| {_f(gap['p99'])} / {_f(gap['max'])} | {s['underruns']}{silent} "
        f"| {_f(s['barge_in_stop_ms']['p50'])} "
        f"| {_codes(s['errors_by_code'])} | {_admissions(s)} |\n"
    )


def _host(lv: dict[str, Any]) -> str:
    h = lv["summary"].get("host") or {}
    if not h:
        return "–"
    load = h.get("loadavg_1m") or [None, None]
    return f"{_f(h.get('cpu_percent'), 0, '%')} of {h.get('cpus')}00% / {_f(load[0], 1)} → {_f(load[1], 1)}"


def server_row(lv: dict[str, Any]) -> str:
    sv, c = lv["server"], lv["summary"].get("client", {})
    if not sv.get("available"):
        blanks = " – |" * 5
        return (
            f"| {lv['label']} | {lv['sessions']} |{blanks} {_f(c.get('cpu_percent'), 0, '%')} | – "
            f"| {_host(lv)} |\n"
        )
    lag, st = sv["loop_lag_ms"], sv["server_ttfa_ms"]
    tree = sv.get("process_tree") or {}
    with_redis = f" ({_f(tree.get('cpu_mean_percent'), 0, '%')} with redis)" if tree else ""
    return (
        f"| {lv['label']} | {lv['sessions']} | {_f(sv['cpu_mean_percent'], 0, '%')}{with_redis} / "
        f"{_f(sv['cpu_max_percent'], 0, '%')} | {_f(sv.get('cpu_ms_per_session_s'), 2)} "
        f"| {_f(sv['idle_rss_mb'])} → {_f(sv['peak_rss_mb'])} MB "
        f"({_f(sv['rss_growth_mb'], 0, ' MB')}; {_f(sv.get('peak_conversation_audio_mb'), 0, ' MB')} audio; "
        f"{_f(sv.get('peak_held_audio_mb'), 0, ' MB')} held) "
        f"| {_f(lag['p99'], 1, ' ms')} "
        f"| {_f(st['p50'])} / {_f(st['p95'])} "
        f"| {_f(c.get('cpu_percent'), 0, '%')} / {_f((c.get('loop_lag_ms') or {}).get('p99'), 0, ' ms')} "
        f"| {c.get('late_sends', 0)} | {_host(lv)} |\n"
    )


WORLD_HEADER = (
    "| config | N | fps asked | fps min / p50 / mean | frames | frame jitter p50 / p99 / max "
    "| late chunks | action → frame p50 / p95 / p99 | queued → applied p50 / p95 | server queued → out p50 "
    "| actions sent / applied (late) | errors | admitted / refused |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n"
)


def world_row(lv: dict[str, Any]) -> str:
    s = lv["summary"]
    w = s.get("world") or {}
    fps, jit = w.get("fps") or {}, w.get("frame_jitter_ms") or {}
    act, qa = w.get("action_ms") or {}, w.get("queued_to_applied_ms") or {}
    srv = w.get("server_action_ms") or {}
    return (
        f"| {lv['label']} | {lv['sessions']} | {_f(w.get('fps_requested'))} "
        f"| {_f(fps.get('min'), 1)} / {_f(fps.get('p50'), 1)} / {_f(fps.get('mean'), 1)} "
        f"| {w.get('frames', 0)} "
        f"| {_f(jit.get('p50'), 1)} / {_f(jit.get('p99'), 1)} / {_f(jit.get('max'), 1)} "
        f"| {w.get('late_chunks', 0)} | {_f(act.get('p50'))} / {_f(act.get('p95'))} / {_f(act.get('p99'))} "
        f"| {_f(qa.get('p50'))} / {_f(qa.get('p95'))} | {_f(srv.get('p50'))} "
        f"| {w.get('actions_sent', 0)} / {w.get('actions_applied', 0)} "
        f"({w.get('applied_later_than_declared', 0)}) "
        f"| {_codes(s['errors_by_code'])} | {_admissions(s)} |\n"
    )


def _is_world(results: dict[str, Any]) -> bool:
    levels = results.get("levels") or []
    return bool(levels) and levels[0].get("workload", {}).get("scenario") == "world"


def _workload_line(w: dict[str, Any]) -> str:
    if w.get("scenario") == "world":
        return (
            f"Workload: scenario `world`, model `{w.get('model') or 'tiny-jepa'}`,"
            f" {w.get('video_format', 'jpeg')} {w.get('width')}×{w.get('height')} at {_f(w.get('fps'))} fps,"
            f" a key event every {w.get('action_every_s')} s on average (± 50 %), ramp {w['ramp_s']} s,"
            f" duration {w['duration_s']} s.\n\n"
        )
    transport = (
        "mic on the call's audio track (48 kHz Opus, 20 ms frames) in real time"
        if w.get("scenario") == "voice-webrtc"
        else f"appends of {w['append_ms']} ms in real time"
    )
    return (
        f"Workload: scenario `{w['scenario']}`, speech `{w['speech']}`, turns by `{w['turn_detection']}`"
        f" (silence {w['silence_ms']} ms), {transport},"
        f" ramp {w['ramp_s']} s,"
        f" duration {w['duration_s']} s, pause {w['pause_s']} s, barge-in {w['barge_in']:.0%},"
        f" playout prebuffer {w['prebuffer_ms']} ms.\n\n"
    )


def verdict_lines(lv: dict[str, Any]) -> list[str]:
    return [
        f"- {'PASS' if v['ok'] else 'FAIL'}: `{v['objective']}` (measured {_f(v['actual'], 1)})"
        for v in lv.get("slo", [])
    ]


def render(results: dict[str, Any], plot_links: list[str]) -> str:
    out: list[str] = [f"# Load test: {results.get('name', '')}\n\n"]
    out.append(f"Command:\n\n```\n{results['command']}\n```\n\n")
    host = results.get("host", {})
    out.append(
        f"Run {results.get('created_at', '')} on {host.get('cpus', '?')} CPUs "
        f"({host.get('cpu_model', '')}), {host.get('memory_gb', '?')} GB;"
        " client and server share the host.\n\n"
    )
    if results.get("nice"):
        out.append(
            f"The load generator and the server ran at niceness {results['nice']} (the host is shared"
            " with other work; see the host CPU column).\n\n"
        )
    levels = results["levels"]
    if levels:
        out.append(_workload_line(levels[0]["workload"]))
    world = _is_world(results)
    if world:
        out.append("## World sessions, client-measured (ms unless noted)\n\n")
        out.append(WORLD_HEADER + "".join(world_row(lv) for lv in levels) + "\n")
    else:
        out.append("## Client-measured, per turn (ms)\n\n")
        out.append(LEVEL_HEADER + "".join(level_row(lv) for lv in levels) + "\n")
    out.append("## Server, from `/metrics`\n\n")
    out.append(SERVER_HEADER + "".join(server_row(lv) for lv in levels) + "\n")
    verdicts = [(lv, verdict_lines(lv)) for lv in levels if lv.get("slo")]
    if verdicts:
        out.append("## Objectives\n\n")
        for lv, lines in verdicts:
            out.append(f"{lv['label']} N={lv['sessions']}:\n\n" + "\n".join(lines) + "\n\n")
    if results.get("comparison"):
        out.append(render_comparison(results["comparison"]))
    if results.get("capacity"):
        cap = results["capacity"]
        out.append(
            f"## Capacity\n\nLargest N meeting `{cap['slo']}`: **{cap['capacity']}** "
            f"(probed {', '.join(str(n) for n in cap['probed'])}).\n\n"
        )
    if plot_links:
        out.append("## Plots\n\n" + "".join(f"![{Path(p).stem}]({p})\n\n" for p in plot_links))
    out.append((WORLD_GLOSSARY if world else GLOSSARY) + SERVER_GLOSSARY)
    if levels and levels[0]["workload"].get("scenario") == "voice-webrtc":
        out.append(WEBRTC_NOTE)
    return "".join(out)


def render_comparison(cmp: dict[str, Any]) -> str:
    a, b = cmp["baseline"], cmp["other"]
    lines = [
        f"## Ratios: {b} / {a}\n\n",
        "| N | TTFA p50 | TTFA p95 | first→last p50 | RTF p50 | server CPU mean |\n",
        "|---:|---:|---:|---:|---:|---:|\n",
    ]
    for row in cmp["rows"]:
        r = row["ratios"]
        lines.append(
            f"| {row['sessions']} | {_f(r.get('ttfa_p50'), 2)} | {_f(r.get('ttfa_p95'), 2)} "
            f"| {_f(r.get('stream_p50'), 2)} | {_f(r.get('rtf_p50'), 2)} | {_f(r.get('server_cpu'), 2)} |\n"
        )
    return "".join(lines) + "\n"


GLOSSARY = """## What the columns mean

- **TTFA**: end of speech (the last speech sample sent; for manual turns, the commit) → first
  `response.output_audio.delta` received. With server VAD it includes the silence window.
- **first→last**: first to last output delta of a completed reply. **RTF**: (end of speech →
  last delta) / reply audio duration.
- **delta gap**: interval between consecutive output deltas of one reply.
- **underruns**: a simulated client playout buffer (playback starts `prebuffer_ms` after the
  first delta, then plays in real time) ran dry before the next delta arrived. Each turn in
  the JSON lists when (`underrun_at`, the client's `CLOCK_MONOTONIC` seconds, the clock other
  processes on the host read too): one stall hits every session streaming at that moment.
- **barge-in stop**: the client's interruption (speech onset with server VAD, or
  `response.cancel`) → `response.done` (cancelled) of the interrupted reply.
"""

SERVER_GLOSSARY = """- **server TTFA**: the server's own histogram, response start → first pipeline audio.
- **CPU ms per session-s**: server CPU time divided by the integral of open sessions over
  time: what one session costs, little affected by other load on the host.
- **conversation audio**: audio the server holds in open sessions' conversations (peak): the
  newest items' audio, PCM16, at most `--audio-retention-s` (default 10 s) per conversation;
  older items keep their transcripts.
- **held audio**: the audio deltas the server keeps for a resume on it (peak; their PCM and
  each response's JSON around it once, Redis does not keep them; before 2026-12-06 their event
  JSON): at most `--audio-replay-max-bytes` (4 MiB) per session, none older
  than 55 s while connected.
- **loop lag**: how late a 100 ms timer fires on the server's event loop.
- **host CPU**: every process on the host, in % of one core (the host has `cpus` × 100 %),
  and the 1-minute load average at the start and end of the level; when it is well above
  server + client, other work competed for the CPUs and latencies include that.
- **client loop lag**: the same timer on the load generator's loop; when it is high, client
  timestamps (and so the latencies above) include the client's own delay.
- **late client sends**: appends the load generator sent > 20 ms behind schedule (if many, the
  client, not the server, is the bottleneck).
"""


WEBRTC_NOTE = """
Over WebRTC (`voice-webrtc`) the answer arrives as 20 ms Opus frames on the call's track, not
as deltas: **TTFA** ends at the arrival of the first RTP packet whose decoded peak is above
0.02 (tapped before aiortc's jitter buffer); **first→last**, **RTF**, **gaps** and
**underruns** count the answer's non-silent frames (digital silence the server's track sends
while the pipeline is behind is missing audio; **silent frames** counts those frames between
audible frames of a reply, so underruns without them are transport or client lateness). The
track plays in real time, so RTF ≥ 1.
**barge-in stop** ends at the first frame of the silence that followed the interruption
(`output_audio_buffer.cleared` when no such frame was seen).
"""

WORLD_GLOSSARY = """## What the columns mean

- **fps**: frames received per second by each session after its first second (min, median and
  mean over sessions).
- **frame jitter**: each chunk's arrival interval minus the play time of the previous chunk
  (`frame_count / fps`; with one frame per chunk, *frame interval − 1/fps*), in ms, pooled over
  sessions; positive is late. **late chunks**: more than half a frame period late.
- **action → frame**: a key event's `session.interaction` sent → arrival of the first chunk the
  server says it shaped (`session.interaction.applied` precedes that chunk).
- **queued → applied**: arrival of `session.interaction.queued` → of `.applied`, client clock;
  **server queued → out**: the server's own `latency_ms` in `.applied`.
- **actions sent / applied (late)**: key events sent, applied, and applied on a later chunk
  than the `applies_at_chunk` the server declared.
"""

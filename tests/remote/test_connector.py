"""The mooncake connector over real transfer engines (loopback TCP): round trips, ownership,
bounds, the reaper, and a peer that dies."""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from runtime.connectors import ConnectorError, Handle
from runtime.payloads import AudioChunk, Payload, TextDelta
from runtime.remote.connector import MooncakeConnector, MooncakeRef
from runtime.remote.transfer import TransferEndpoint

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Recorder:
    """Where a connector sends releases and cleanups of other processes' slices (the control
    plane in the runtime): here a list, to see what would be sent."""

    released: list[tuple[str, str]]
    cleaned: list[str]

    def release(self, owner: str, handles: list[Handle]) -> None:
        self.released += [(owner, h.key) for h in handles]

    def cleanup(self, request_id: str) -> None:
        self.cleaned.append(request_id)


@pytest.fixture(scope="module")
def pair() -> tuple[MooncakeConnector, MooncakeConnector, Recorder]:
    recorder = Recorder([], [])
    owner = MooncakeConnector(TransferEndpoint("127.0.0.1", 4 << 20))
    reader = MooncakeConnector(TransferEndpoint("127.0.0.1", 4 << 20), owners=recorder)
    return owner, reader, recorder


def test_payloads_cross_between_engines_with_arrays_tensors_and_dataclasses(pair: tuple) -> None:
    owner, reader, _ = pair
    audio = AudioChunk(np.sin(np.arange(48_000, dtype=np.float32)), 24_000)
    payload: dict[str, Any] = {
        "audio": audio,
        "t": torch.arange(4096, dtype=torch.bfloat16),
        "text": TextDelta("hé"),
    }
    handle = owner.put("r1", "k1", cast(Payload, payload), refs=2)
    assert (
        isinstance(handle.ref, MooncakeRef)
        and handle.ref.owner == owner.session
        and handle.ref.inline is None
    )
    got = cast(dict[str, Any], reader.get(handle))
    assert np.array_equal(got["audio"].samples, audio.samples) and got["audio"].sample_rate == 24_000
    assert got["t"].dtype == torch.bfloat16 and torch.equal(got["t"], payload["t"])
    assert got["text"] == TextDelta("hé")
    assert reader.health()["bytes_pulled"] >= handle.ref.nbytes
    assert not owner.release(handle) and owner.release(handle)  # two references
    with pytest.raises(ConnectorError, match="gone"):
        owner.get(handle)
    assert owner.health()["pool_used_bytes"] == 0


def test_small_payloads_ride_inline_and_hold_no_slice(pair: tuple) -> None:
    owner, reader, _ = pair
    handle = owner.put("r2", "k", TextDelta("short"))
    assert handle.ref.inline is not None and handle.ref.owner == ""
    assert reader.get(handle) == TextDelta("short") and owner.health()["items"] == 0


def test_releases_and_cleanups_of_foreign_slices_go_to_their_owner(pair: tuple) -> None:
    owner, reader, recorder = pair
    handle = owner.put("r3", "big", AudioChunk(np.zeros(8192, np.float32), 24_000))
    reader.get(handle)
    reader.release(handle)
    assert recorder.released == [(owner.session, "big")]
    reader.cleanup("r3")
    assert recorder.cleaned == ["r3"]
    assert owner.drop("r3") == 1 and owner.health()["pool_used_bytes"] == 0


def test_the_pool_bounds_what_a_process_holds_and_the_reaper_frees_abandoned_slices() -> None:
    now = [0.0]
    conn = MooncakeConnector(TransferEndpoint("127.0.0.1", 1 << 20), ttl_s=60, clock=lambda: now[0])
    kept = conn.put("r", "a", AudioChunk(np.zeros(600_000 // 4, np.float32), 24_000))
    with pytest.raises(ConnectorError, match=r"no \d+ B free run"):
        conn.put("r", "b", AudioChunk(np.zeros(600_000 // 4, np.float32), 24_000))
    now[0] = 30.0
    assert conn.reap() == 0
    now[0] = 61.0
    assert conn.reap() == 1 and conn.health()["pool_used_bytes"] == 0
    with pytest.raises(ConnectorError):
        conn.get(kept)
    conn.close()


def test_a_pulled_payload_is_decoded_in_place_and_its_slice_returns_when_it_is_gone() -> None:
    owner = MooncakeConnector(TransferEndpoint("127.0.0.1", 8 << 20))
    # split_min 256 KiB: a 1 MiB pull goes as 4 concurrent parts, reassembled in order
    reader = MooncakeConnector(TransferEndpoint("127.0.0.1", 8 << 20, split_min=256 << 10))
    samples = np.random.default_rng(1).standard_normal(1 << 18).astype(np.float32)  # 1 MiB
    handle = owner.put("r", "k", AudioChunk(samples, 24_000))
    got = reader.get(handle)
    assert isinstance(got, AudioChunk) and np.array_equal(got.samples, samples)
    health = reader.health()
    assert health["lent_bytes"] == handle.ref.nbytes and health["pool_used_bytes"] >= handle.ref.nbytes
    # the array is a view of the reader's registered pool: no copy was made
    base = reader.endpoint.array(0, reader.endpoint.pool.size)
    assert np.shares_memory(got.samples, base)
    view = got.samples[10:20]
    del got
    assert reader.health()["lent_bytes"] > 0  # a slice of the array still holds it
    del view
    assert reader.health()["lent_bytes"] == 0 and reader.health()["pool_used_bytes"] == 0
    assert reader.endpoint.reads == 1
    # a lent payload in a reference cycle, collected while this thread holds the connector's
    # lock (a collection can start at any allocation): the finalizer takes no lock, no deadlock
    cycle: list[Any] = [reader.get(handle)]
    cycle.append(cycle)
    del cycle
    with reader._lock:
        gc.collect()
    assert reader.health()["lent_bytes"] == 0 and reader.health()["pool_used_bytes"] == 0
    owner.close()
    reader.close()


def test_past_lend_max_a_pulled_payload_is_copied_out_and_the_slice_freed_at_once() -> None:
    owner = MooncakeConnector(TransferEndpoint("127.0.0.1", 4 << 20))
    reader = MooncakeConnector(TransferEndpoint("127.0.0.1", 4 << 20), lend_max=300_000)
    chunks = [owner.put("r", str(i), AudioChunk(np.full(50_000, i, np.float32), 24_000)) for i in range(3)]
    kept = [reader.get(h) for h in chunks]  # 200 KB each: the first is lent, the rest copied
    assert [float(k.samples[0]) for k in kept if isinstance(k, AudioChunk)] == [0.0, 1.0, 2.0]
    health = reader.health()
    assert health["lent_bytes"] == chunks[0].ref.nbytes
    assert health["pool_used_bytes"] == -(-chunks[0].ref.nbytes // 64) * 64
    del kept
    assert reader.health()["pool_used_bytes"] == 0
    owner.close()
    reader.close()


def test_a_bad_transfer_timeout_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.remote.transfer import TransferError

    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "soon")
    with pytest.raises(TransferError, match="MC_TRANSFER_TIMEOUT='soon' is not a number"):
        TransferEndpoint("127.0.0.1", 1 << 20)


OWNER = """
import sys, time, numpy as np
from runtime.payloads import AudioChunk
from runtime.remote.connector import MooncakeConnector
from runtime.remote.transfer import TransferEndpoint
c = MooncakeConnector(TransferEndpoint("127.0.0.1", 1 << 20))
h = c.put("r", "k", AudioChunk(np.ones(100_000, np.float32), 24_000))
r = h.ref
print(r.owner, r.address, r.nbytes, r.header, r.buffers[0][0], r.buffers[0][1], flush=True)
time.sleep(120)
"""


def test_a_killed_owner_is_an_error_at_once_not_a_hang() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        stderr=subprocess.DEVNULL,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    try:
        assert proc.stdout is not None
        owner, address, nbytes, header, offset, length = proc.stdout.readline().split()
        ref = MooncakeRef(owner, int(address), int(nbytes), int(header), ((int(offset), int(length)),))
        handle = Handle("mooncake", "r", "k", ref)
        reader = MooncakeConnector(TransferEndpoint("127.0.0.1", 1 << 20))
        got = reader.get(handle)
        assert isinstance(got, AudioChunk) and np.array_equal(got.samples, np.ones(100_000, np.float32))
        proc.kill()
        proc.wait(10)
        started = time.monotonic()
        with pytest.raises(ConnectorError, match="failed"):
            reader.get(handle)
        assert time.monotonic() - started < 6
        reader.close()
    finally:
        proc.kill()

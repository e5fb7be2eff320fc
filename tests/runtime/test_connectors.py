from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.connector_registry import make_connectors
from runtime.connectors import ConnectorError, InProcessConnector
from runtime.payloads import AudioChunk, CodecCodes, Conditioning, HiddenStates, KVBlocks, TextDelta
from runtime.shm import SHM_DIR, SharedMemoryConnector, sweep_segments

pytestmark = pytest.mark.system


def segments(prefix: str) -> list[str]:
    return sorted(p.name for p in Path(SHM_DIR).iterdir() if p.name.startswith(prefix))


@pytest.fixture
def shm() -> Iterator[SharedMemoryConnector]:
    connector = SharedMemoryConnector()
    yield connector
    connector.close()
    assert segments(connector.prefix) == []


def test_inproc_is_by_reference_with_refcounts_and_cleanup() -> None:
    connector = InProcessConnector()
    payload = CodecCodes(np.zeros((2, 4), dtype=np.int64))
    handle = connector.put("r1", "k1", payload, refs=2)
    assert connector.get(handle) is payload  # no copy
    assert connector.release(handle) is False and connector.get(handle) is payload
    assert connector.release(handle) is True
    with pytest.raises(ConnectorError, match="gone"):
        connector.get(handle)
    assert connector.release(handle) is False  # unknown handles are ignored
    connector.put("r1", "a", TextDelta("x"))
    connector.put("r1", "b", TextDelta("y"))
    connector.put("r2", "a", TextDelta("z"))
    assert connector.health()["items"] == 3
    assert connector.cleanup("r1") == 2 and connector.cleanup("r1") == 0
    assert connector.health() == {"kind": "inproc", "ok": True, "requests": 1, "items": 1}


def test_shm_round_trip_of_arrays_and_tensors(shm: SharedMemoryConnector) -> None:
    codes = np.arange(24, dtype=np.int64).reshape(6, 4)[:, ::2]  # non-contiguous view
    hidden = torch.randn(3, 8)
    bf16 = torch.randn(2, 5).to(torch.bfloat16)
    cases = [
        CodecCodes(codes),
        HiddenStates(hidden, layer=7),
        HiddenStates(bf16),
        AudioChunk(np.zeros(0, dtype=np.float32), sample_rate=24000),
        KVBlocks([{"k": torch.ones(2, 2), "v": np.full(3, 2.5)}, (np.int8(3), "meta")], num_tokens=5),
        Conditioning({"prompt": "hi", "weights": np.array([0.5, 1.5])}),
        TextDelta("no arrays at all"),
    ]
    handles = [shm.put("r1", f"k{i}", p) for i, p in enumerate(cases)]
    assert len(segments(shm.prefix)) == 6  # one segment per payload with arrays
    out = [shm.get(h) for h in handles]
    np.testing.assert_array_equal(out[0].codes, codes)
    assert out[0].codes.flags.c_contiguous
    assert isinstance(out[1].tensor, torch.Tensor) and out[1].layer == 7
    torch.testing.assert_close(out[1].tensor, hidden)
    assert out[2].tensor.dtype == torch.bfloat16 and torch.equal(out[2].tensor, bf16)
    assert out[3].samples.shape == (0,) and out[3].sample_rate == 24000
    blocks = out[4].blocks
    torch.testing.assert_close(blocks[0]["k"], torch.ones(2, 2))
    np.testing.assert_array_equal(blocks[0]["v"], np.full(3, 2.5))
    assert blocks[1][1] == "meta" and out[4].num_tokens == 5
    assert out[5].values["prompt"] == "hi"
    np.testing.assert_array_equal(out[5].values["weights"], [0.5, 1.5])
    assert out[6] == TextDelta("no arrays at all")
    out[0].codes[0, 0] = 99  # a copy: writing it does not touch the stored payload
    assert shm.get(handles[0]).codes[0, 0] == 0
    assert shm.health()["items"] == 7 and shm.health()["segments"] == 6


def test_shm_release_and_cleanup_unlink_segments(shm: SharedMemoryConnector) -> None:
    a = shm.put("r1", "a", CodecCodes(np.ones((4, 2), dtype=np.int64)), refs=2)
    shm.put("r1", "b", CodecCodes(np.ones((4, 2), dtype=np.int64)))
    shm.put("r2", "a", CodecCodes(np.ones((4, 2), dtype=np.int64)))
    assert len(segments(shm.prefix)) == 3
    assert shm.release(a) is False and len(segments(shm.prefix)) == 3
    assert shm.release(a) is True and len(segments(shm.prefix)) == 2
    with pytest.raises(ConnectorError, match="gone"):
        shm.get(a)
    assert shm.cleanup("r1") == 1 and len(segments(shm.prefix)) == 1
    assert shm.health()["bytes"] > 0
    shm.close()
    assert segments(shm.prefix) == []


def test_shm_producer_adopt_and_sweep(shm: SharedMemoryConnector) -> None:
    prefix = shm.child_prefix()
    assert prefix.startswith(shm.prefix)
    producer = SharedMemoryConnector.producer(prefix)
    handle = producer.put("r1", "x", CodecCodes(np.full((2, 2), 3, dtype=np.int64)))
    producer.put("r1", "lost", CodecCodes(np.zeros((1, 1), dtype=np.int64)))  # never reported
    assert len(segments(prefix)) == 2 and shm.health()["items"] == 0
    shm.adopt(handle)
    assert shm.get(handle).codes.sum() == 12 and shm.health()["items"] == 1
    assert sweep_segments(prefix) == 2  # a dead child's leftovers, adopted or not
    assert segments(prefix) == []
    assert shm.cleanup("r1") == 1  # bookkeeping survives a segment already gone


def test_make_connectors() -> None:
    connectors = make_connectors({"inproc", "shm"})
    assert set(connectors) == {"inproc", "shm"} and connectors["shm"].health()["ok"]
    for connector in connectors.values():
        connector.close()
    with pytest.raises(ValueError):
        make_connectors({"rdma"})

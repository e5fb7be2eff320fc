"""The audio stores: bytes read back identical, discard unlinks, I/O errors keep audio in
memory, stale spools of dead processes removed, a spool's own directory removed on close."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from runtime.capabilities import PipelineCapabilities
from session.realtime.audio_store import (
    MemoryAudioStore,
    SpoolAudioStore,
    _hold_lock,
    lock_path,
    remove_stale_spools,
)
from session.realtime.config import SessionConfig
from session.realtime.conversation import Content, Conversation, Item
from web.cli import build_parser
from web.server.context import audio_spool
from web.server.session_factory import CoreFactory
from web.settings import ServerSettings

pytestmark = pytest.mark.system


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[SpoolAudioStore]:
    store = SpoolAudioStore.open(tmp_path)
    try:
        yield store
    finally:
        store.close()


def audio_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(-32768, 32767, n // 2, dtype=np.int16).tobytes()


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_memory_store_round_trip_and_discard() -> None:
    store = MemoryAudioStore()
    data = audio_bytes(3200)
    handle = store.put(data)
    assert handle.read() == data and handle.nbytes == 3200 and handle.resident_bytes == 3200
    handle.discard()
    handle.discard()  # idempotent
    assert handle.read() is None and handle.resident_bytes == 0


def test_spilled_bytes_are_written_to_a_file_and_read_back_identical(spool: SpoolAudioStore) -> None:
    parts = [audio_bytes(32_000, seed=k) for k in range(5)]
    handles = [spool.put(p) for p in parts]
    # before, during or after its write: always the same bytes
    assert [h.read() for h in handles] == parts
    assert spool.wait_idle()
    for handle, data in zip(handles, parts, strict=True):
        assert handle.state == "written" and handle.resident_bytes == 0
        assert handle.path is not None and Path(handle.path).parent == spool.directory
        assert Path(handle.path).read_bytes() == data
        assert handle.read() == data
    assert spool.spooled_bytes == 5 * 32_000
    assert spool.resident_bytes == 0 and spool.pending_bytes == 0
    assert spool.directory.name.startswith(f"{os.getpid()}-")


def test_discard_unlinks_the_file(spool: SpoolAudioStore) -> None:
    data = audio_bytes(6400)
    handle = spool.put(data)
    assert spool.wait_idle()
    assert handle.path is not None
    path = Path(handle.path)
    assert path.exists()
    handle.discard()
    assert spool.wait_idle()
    assert not path.exists()
    assert handle.state == "discarded" and handle.read() is None
    assert spool.spooled_bytes == 0 and spool.resident_bytes == 0
    assert list(spool.directory.iterdir()) == []


def test_discard_right_after_put_leaves_no_file(spool: SpoolAudioStore) -> None:
    handles = [spool.put(audio_bytes(1600, seed=k)) for k in range(20)]
    for handle in handles:
        handle.discard()
    assert spool.wait_idle()
    assert list(spool.directory.iterdir()) == []
    assert (spool.spooled_bytes, spool.resident_bytes, spool.pending_bytes) == (0, 0, 0)


def test_io_error_keeps_the_audio_in_memory_and_logs_once(
    spool: SpoolAudioStore, caplog: pytest.LogCaptureFixture
) -> None:
    os.rmdir(spool.directory)  # every write now fails (no such directory)
    parts = [audio_bytes(3200, seed=k) for k in range(3)]
    with caplog.at_level(logging.WARNING, logger="session.realtime.audio_store"):
        handles = [spool.put(p) for p in parts]
        assert spool.wait_idle()
    assert [h.state for h in handles] == ["memory"] * 3
    assert [h.read() for h in handles] == parts  # never lost
    assert spool.write_failures == 3 and spool.resident_bytes == 3 * 3200 and spool.spooled_bytes == 0
    assert len([r for r in caplog.records if "write failed" in r.message]) == 1
    handles[0].discard()
    assert spool.wait_idle()
    assert spool.resident_bytes == 2 * 3200


def test_a_writer_too_far_behind_keeps_audio_in_memory(tmp_path: Path) -> None:
    store = SpoolAudioStore.open(tmp_path, max_pending_bytes=1000)
    try:
        data = audio_bytes(3200)
        handle = store.put(data)
        assert handle.state == "memory" and handle.read() == data
        assert store.resident_bytes == 3200 and store.pending_bytes == 0
    finally:
        store.close()


def test_a_lost_file_reads_as_gone(spool: SpoolAudioStore) -> None:
    handle = spool.put(audio_bytes(3200))
    assert spool.wait_idle()
    assert handle.path is not None
    os.unlink(handle.path)
    assert handle.read() is None


def test_open_removes_stale_spools_of_dead_processes_only(tmp_path: Path) -> None:
    base = tmp_path / "audio-spool"
    stale = base / f"{dead_pid()}-0123abcd"
    live = base / f"{os.getppid()}-4567ef01"  # the process that started the tests: alive
    other = base / "notes"
    for folder in (stale, live, other):
        folder.mkdir(parents=True)
        (folder / "0.audio").write_bytes(b"\0" * 64)
    store = SpoolAudioStore.open(tmp_path)
    try:
        assert not stale.exists()
        assert live.exists() and other.exists()
        assert store.directory.parent == base and store.directory.exists()
        assert remove_stale_spools(base) == []  # its own directory is never stale
    finally:
        store.close()


def test_a_spool_is_stale_when_its_lock_is_free_whatever_its_pid(tmp_path: Path) -> None:
    """The lock decides, not the pid: a data dir shared by containers (other pid namespaces)
    shows live spools under pids that are dead here, and a reused pid looks alive."""
    base = tmp_path / "audio-spool"
    elsewhere = base / f"{dead_pid()}-aaaa0000"  # its owner lives in another pid namespace
    reused = base / f"{os.getppid()}-bbbb1111"  # died; its pid now names a live process
    for folder in (elsewhere, reused):
        folder.mkdir(parents=True)
        (folder / "0.audio").write_bytes(b"\0" * 64)
        lock_path(folder).touch()
    held = _hold_lock(elsewhere)
    try:
        assert remove_stale_spools(base) == [reused]
        assert elsewhere.exists() and not reused.exists()
    finally:
        os.close(held)
    assert remove_stale_spools(base) == [elsewhere]  # its owner gone: the lock is free


def test_close_removes_its_directory_and_later_puts_stay_in_memory(tmp_path: Path) -> None:
    store = SpoolAudioStore.open(tmp_path)
    handle = store.put(audio_bytes(3200))
    assert store.wait_idle()
    store.close()
    assert not store.directory.exists()
    assert handle.state == "written" and handle.read() is None  # gone with the spool
    late = store.put(b"\1\2")
    assert late.state == "memory" and late.read() == b"\1\2"
    store.close()  # idempotent


def test_spool_without_a_data_dir_uses_the_temp_dir() -> None:
    store = SpoolAudioStore.open(None)
    try:
        assert store.directory.exists()
        assert str(store.directory).startswith(tempfile.gettempdir())
    finally:
        store.close()
    assert not store.directory.exists()


def test_a_collected_conversation_discards_its_spilled_audio(spool: SpoolAudioStore) -> None:
    """The backstop for a session nobody closed: spilled files go with the conversation."""
    conversation = Conversation(spool)
    for k in range(3):
        pcm = np.full(1600, k, dtype=np.int16)
        conversation.insert(
            Item(f"u{k}", "message", role="user", content=[Content("input_audio", input_audio=pcm)])
        )
        conversation.insert(
            Item(f"a{k}", "message", role="assistant", content=[Content("output_text", text="ok")])
        )
    conversation.retain_audio(60.0)
    assert spool.wait_idle()
    assert len(list(spool.directory.iterdir())) == 3
    del conversation
    gc.collect()
    assert spool.wait_idle()
    assert list(spool.directory.iterdir()) == [] and spool.spooled_bytes == 0


def test_the_spool_flag_reaches_core_options(tmp_path: Path) -> None:
    assert ServerSettings.from_args(build_parser().parse_args(["serve"])).audio_spool is True
    off = ServerSettings.from_args(build_parser().parse_args(["serve", "--no-audio-spool"]))
    assert off.audio_spool is False

    async def spools(settings: ServerSettings) -> tuple[SpoolAudioStore | None, bool]:
        async with audio_spool(settings) as spool:
            cores = CoreFactory(settings, PipelineCapabilities(), spool)
            assert cores.core_options(SessionConfig(), "sess_x").audio_store is spool
            return spool, spool is not None and spool.directory.is_dir()

    on = ServerSettings(data_dir=str(tmp_path))
    spool, existed = asyncio.run(spools(on))
    assert spool is not None and existed and spool.directory.parent == tmp_path / "audio-spool"
    assert not spool.directory.exists()  # removed on exit
    assert asyncio.run(spools(replace(on, audio_spool=False))) == (None, False)

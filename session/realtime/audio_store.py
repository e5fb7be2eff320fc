"""Where a conversation keeps item audio that no prompt needs any more.

A conversation retains seconds of audio per session for `conversation.item.retrieve` and
`conversation.item.truncate`; pipelines only ever take the trailing user items' audio. With
hundreds of sessions the rest is tens of megabytes of heap that nothing reads, so the
conversation hands it to an :class:`AudioStore` and keeps a handle (see
`Conversation.retain_audio` for when).

The core stays synchronous and free of I/O of its own: `put`, `discard` and `close` never
block on the disk. :class:`MemoryAudioStore` keeps the bytes on the heap (tests of the core);
:class:`SpoolAudioStore` (the server's) writes each part to its own file from one background
thread. Until that write lands, and for good if it fails (disk full, I/O error), the bytes
stay in memory: audio is never lost to the spool and the session never sees its errors.
Reading spilled audio back is a plain read of a small file (a retrieve, a truncate): cheap
enough to do where it is asked for.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import queue
import re
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Literal, Protocol

from session.store.embedded import pid_alive

log = logging.getLogger(__name__)

# Where a handle's bytes are. PENDING: queued for the writer, still in memory. WRITTEN: in
# its file only. MEMORY: in memory for good (the write failed, or the writer is too far
# behind). DISCARDED: gone.
HandleState = Literal["pending", "written", "memory", "discarded"]

_SPOOL_NAME = re.compile(r"^(\d+)-[0-9a-f]+$")


class AudioHandle:
    """One stored audio part: its size, and where its bytes are (owned by its store)."""

    __slots__ = ("_memory", "nbytes", "path", "state", "store")

    def __init__(self, store: AudioStore, data: bytes, state: HandleState, path: str | None = None) -> None:
        self.store = store
        self.nbytes = len(data)
        self._memory: bytes | None = data
        self.state: HandleState = state
        self.path = path

    @property
    def resident_bytes(self) -> int:
        """Bytes of this part held in process memory (0 once it lives only in its file)."""
        return self.nbytes if self._memory is not None else 0

    def read(self) -> bytes | None:
        """The stored bytes; None when they are gone (discarded, or the file was lost)."""
        return self.store.get(self)

    def discard(self) -> None:
        self.store.discard(self)


class AudioStore(Protocol):
    """Storage for spilled audio parts (all calls are made from one thread: the event loop's)."""

    def put(self, data: bytes) -> AudioHandle:
        """Keep `data`; never blocks on I/O."""
        ...

    def get(self, handle: AudioHandle) -> bytes | None:
        """The bytes put under `handle`; None if they are gone."""
        ...

    def discard(self, handle: AudioHandle) -> None:
        """Forget `handle`'s bytes (idempotent); never blocks, takes no lock (a conversation's
        finalizer calls it, in whatever thread the garbage collector runs)."""
        ...

    def close(self) -> None:
        """Release everything the store holds."""
        ...


class MemoryAudioStore:
    """Spilled audio stays on the heap: the core's behaviour without a disk, for tests."""

    def put(self, data: bytes) -> AudioHandle:
        return AudioHandle(self, bytes(data), "memory")

    def get(self, handle: AudioHandle) -> bytes | None:
        return handle._memory

    def discard(self, handle: AudioHandle) -> None:
        handle._memory = None
        handle.state = "discarded"

    def close(self) -> None:
        pass


class SpoolAudioStore:
    """One file per spilled part in a directory of this process, written by one thread.

    Open it with :meth:`open` (which also removes the spool directories of dead processes)
    and :meth:`close` it at exit (which removes this one). Writes queue at most
    `max_pending_bytes`; past that a part stays in memory (the writer is behind: better RSS
    than a stalled loop or lost audio).
    """

    def __init__(self, directory: Path, *, max_pending_bytes: int = 32 * 2**20) -> None:
        self.directory = directory
        self.max_pending_bytes = max_pending_bytes
        self.resident_bytes = 0  # queued or kept in memory
        self.spooled_bytes = 0  # in files
        self.pending_bytes = 0  # queued for the writer
        self.write_failures = 0
        self._lock = threading.Lock()  # handle states and the counters above
        self._ops: queue.SimpleQueue[tuple[str, object] | None] = queue.SimpleQueue()
        self._names = itertools.count()
        self._closed = False
        self._lock_fd: int | None = None  # held while the spool lives (see remove_stale_spools)
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._write_loop, name="audio-spool", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, root: str | os.PathLike[str] | None, **kwargs: int) -> SpoolAudioStore:
        """A spool in a new directory under `root` (None or "": the system temp dir), named
        after this process so a later start can tell it is stale. Blocking: call it off the loop."""
        base = Path(root) if root else Path(tempfile.gettempdir()) / "omniduplex"
        base = base / "audio-spool"
        base.mkdir(parents=True, exist_ok=True)
        remove_stale_spools(base)
        directory = base / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        directory.mkdir()
        lock = _hold_lock(directory)
        store = cls(directory, **kwargs)
        store._lock_fd = lock
        return store

    # --- AudioStore ------------------------------------------------------------------------

    def put(self, data: bytes) -> AudioHandle:
        data = bytes(data)
        with self._lock:
            if self._closed or self.pending_bytes + len(data) > self.max_pending_bytes:
                handle = AudioHandle(self, data, "memory")
                self.resident_bytes += handle.nbytes
                behind = not self._closed
            else:
                name = str(self.directory / f"{next(self._names)}.audio")
                handle = AudioHandle(self, data, "pending", name)
                self.resident_bytes += handle.nbytes
                self.pending_bytes += handle.nbytes
                self._ops.put(("write", handle))
                behind = False
        if behind:
            self._warn_once("behind", "audio spool writer is behind: keeping audio in memory meanwhile")
        return handle

    def get(self, handle: AudioHandle) -> bytes | None:
        with self._lock:
            data, state, path = handle._memory, handle.state, handle.path
        if data is not None:
            return data
        if state != "written" or path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            self._warn_once("read", f"audio spool: could not read back {path}: {exc}")
            return None

    def discard(self, handle: AudioHandle) -> None:
        # Only queued: `SimpleQueue.put` is safe to call from a finalizer, the lock is not.
        # The writer handles it after the handle's write (FIFO), then unlinks its file.
        self._ops.put(("discard", handle))

    def close(self) -> None:
        """Stop the writer (after what is queued) and remove this spool's directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ops.put(None)
        self._thread.join(timeout=30)
        shutil.rmtree(self.directory, ignore_errors=True)
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(lock_path(self.directory))
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None

    # --- for tests and shutdown --------------------------------------------------------------

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Block until everything queued so far is written or unlinked (not on the loop)."""
        done = threading.Event()
        with self._lock:
            if self._closed:
                return not self._thread.is_alive()
            self._ops.put(("sync", done))
        return done.wait(timeout_s)

    # --- the writer thread -------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (op := self._ops.get()) is not None:
            kind, arg = op
            if kind == "write":
                assert isinstance(arg, AudioHandle)
                self._write(arg)
            elif kind == "discard":
                assert isinstance(arg, AudioHandle)
                self._discard(arg)
            elif kind == "sync":
                assert isinstance(arg, threading.Event)
                arg.set()

    def _write(self, handle: AudioHandle) -> None:
        with self._lock:
            if handle.state != "pending" or self._closed:
                return  # discarded; or closing: its directory goes anyway, the bytes stay readable
            data, path = handle._memory, handle.path
        assert data is not None and path is not None
        try:
            with open(path, "wb") as f:
                f.write(data)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            with self._lock:
                self.write_failures += 1
                if handle.state == "pending":
                    handle.state = "memory"  # kept in memory for good: never lost
                    self.pending_bytes -= handle.nbytes
            self._warn_once("write", f"audio spool: write failed, keeping audio in memory: {exc}")
            return
        with self._lock:
            written = handle.state == "pending"
            if written:
                handle.state = "written"
                handle._memory = None
                self.pending_bytes -= handle.nbytes
                self.resident_bytes -= handle.nbytes
                self.spooled_bytes += handle.nbytes
        if not written:
            self._unlink(path)  # discarded while it was being written

    def _discard(self, handle: AudioHandle) -> None:
        with self._lock:
            state = handle.state
            if state == "discarded":
                return
            handle.state = "discarded"
            if handle._memory is not None:
                handle._memory = None
                self.resident_bytes -= handle.nbytes
            if state == "pending":
                self.pending_bytes -= handle.nbytes
            elif state == "written":
                self.spooled_bytes -= handle.nbytes
        if state == "written" and handle.path is not None:
            self._unlink(handle.path)

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._warn_once("unlink", f"audio spool: could not remove {path}: {exc}")

    def _warn_once(self, key: str, message: str) -> None:
        with self._lock:
            first = key not in self._warned
            self._warned.add(key)
        if first:
            log.warning(message)


def lock_path(directory: Path) -> Path:
    """The lock file of a spool directory (beside it, so the directory holds only audio)."""
    return directory.with_name(directory.name + ".lock")


def _hold_lock(directory: Path) -> int:
    """Lock `directory`'s lock file for as long as the returned descriptor stays open: the
    kernel drops the lock when its process dies, however it dies."""
    fd = os.open(lock_path(directory), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def remove_stale_spools(base: Path) -> list[Path]:
    """Remove the spool directories under `base` whose process is gone; return them.

    A directory is in use while its lock file is locked: a process id alone cannot tell (the
    data dir may be shared by containers with their own pid namespaces, and pids are reused).
    A directory without a lock file (just being created, or from an older version) falls back
    to the process id in its name."""
    removed: list[Path] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _SPOOL_NAME.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        try:
            fd = os.open(lock_path(entry), os.O_RDWR)
        except FileNotFoundError:
            pid = int(match.group(1))
            if pid == os.getpid() or pid_alive(pid):
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its process lives
        else:
            shutil.rmtree(entry, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.unlink(lock_path(entry))
            removed.append(entry)
        finally:
            os.close(fd)
    return removed


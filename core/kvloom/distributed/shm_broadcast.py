"""A one-writer, N-reader broadcast queue in shared memory (vLLM's ``rpc_broadcast_mq``).

The multiprocess executor writes each call (``execute_model`` with the step's
``SchedulerOutput``, ``sample_tokens``, every ``collective_rpc``) once, into shared
memory, and every worker rank reads the same bytes; with pipes the driver copied the
message into each rank's pipe and the kernel copied it again on the way out.

Layout (one ``multiprocessing.shared_memory.SharedMemory`` segment): a ring of
``n_chunks`` chunks. Chunk ``i`` has a flag block of ``1 + n_readers`` bytes at
``i * (1 + n_readers)`` -- a *written* byte and one *read* byte per reader -- and a data
block of ``chunk_bytes`` bytes after all the flag blocks, starting with the message's
length (8 bytes, little endian) and then the message. A message longer than
``chunk_bytes - 8`` goes through the overflow path: its chunk holds the length
``OVERFLOW`` and the bytes follow on each reader's own connection (a
``multiprocessing`` pipe), so that the ring still orders it among the others.

Protocol. The writer fills chunk ``w`` once it is free (never written, or read by every
reader): it clears the written byte, clears the read bytes, writes the data and then sets
the written byte. Reader ``r`` waits at its chunk until the written byte is set and its
own read byte is not (it loads its read byte first: see ``dequeue``), reads the data,
sets its read byte and moves to the next chunk.
Each flag has one writer at a time, so no lock is needed; the data are stored before
the flag that publishes them (x86 keeps stores in order; like vLLM's ring this relies
on it, and on CPython not reordering the byte stores).

Waiting. Both sides check their flag in a loop that yields the core
(``os.sched_yield``) for ``spin_s`` seconds, then sleeps, doubling from 50 us up to
``MAX_SLEEP_S``: an idle worker costs a wake-up per millisecond, not a core. A waiting
side calls its ``alive`` hook every ``CHECK_INTERVAL_S`` (the writer: with the readers
that have not read yet, so that the executor raises for a dead rank instead of waiting
for it; a reader: to notice that the writer is gone) and gives up with ``TimeoutError``
after ``timeout`` seconds, if one is given.

Lifetime. The writer creates the segment and unlinks it in ``close()``; readers attach
by name (``BroadcastHandle``, picklable, passed to the spawned processes) and only
close, unless the writer died first: a reader that sees it gone unlinks the segment
(``close(unlink=True)``); failing that, multiprocessing's resource tracker unlinks it when
the last process sharing the tracker exits.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_N_CHUNKS = 8
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
#: Seconds a waiting side yields the core before it starts sleeping.
DEFAULT_SPIN_S = 0.01
MIN_SLEEP_S = 50e-6
MAX_SLEEP_S = 1e-3
#: Seconds between two calls of a waiting side's ``alive`` hook.
CHECK_INTERVAL_S = 0.05

_LENGTH = struct.Struct("<Q")
#: The length stored in a chunk whose message follows on the readers' connections.
OVERFLOW = (1 << 64) - 1
_DATA_ALIGN = 64


class ReaderGoneError(RuntimeError):
    """Reader ``reader`` cannot receive (its overflow connection is closed)."""

    def __init__(self, reader: int, cause: BaseException) -> None:
        self.reader = reader
        super().__init__(f"broadcast reader {reader} is gone ({cause!r})")


@dataclass(frozen=True)
class BroadcastHandle:
    """What a reader needs to attach: the segment's name and the ring's shape."""

    name: str
    n_readers: int
    n_chunks: int
    chunk_bytes: int


def _check_shape(n_readers: int, n_chunks: int, chunk_bytes: int) -> None:
    if n_readers < 1:
        raise ValueError(f"n_readers={n_readers}: expected >= 1")
    if n_chunks < 2:
        raise ValueError(f"n_chunks={n_chunks}: expected >= 2")
    if chunk_bytes < _LENGTH.size + 1:
        raise ValueError(f"chunk_bytes={chunk_bytes}: expected >= {_LENGTH.size + 1}")


class _Ring:
    """Offsets into the segment shared by both sides."""

    def __init__(self, handle: BroadcastHandle, shm: shared_memory.SharedMemory) -> None:
        self.handle = handle
        self.shm = shm
        self.buf = shm.buf
        self.flag_stride = 1 + handle.n_readers
        flags_bytes = handle.n_chunks * self.flag_stride
        self.data_start = -(-flags_bytes // _DATA_ALIGN) * _DATA_ALIGN

    @staticmethod
    def segment_bytes(n_readers: int, n_chunks: int, chunk_bytes: int) -> int:
        flags_bytes = n_chunks * (1 + n_readers)
        return -(-flags_bytes // _DATA_ALIGN) * _DATA_ALIGN + n_chunks * chunk_bytes

    def flags(self, chunk: int) -> int:
        return chunk * self.flag_stride

    def data(self, chunk: int) -> int:
        return self.data_start + chunk * self.handle.chunk_bytes

    def release(self, unlink: bool) -> None:
        """Detach from the segment and, if ``unlink``, remove it (one already gone is fine)."""
        shm = self.shm
        del self.buf
        shm.close()
        if unlink:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


class _Waiter:
    """Spin, then sleep with backoff; call ``alive`` now and then; honour a timeout."""

    def __init__(self, spin_s: float, timeout: float | None, what: str) -> None:
        self.start = time.monotonic()
        self.spin_until = self.start + spin_s
        self.deadline = None if timeout is None else self.start + timeout
        self.next_check = self.start + CHECK_INTERVAL_S
        self.sleep_s = MIN_SLEEP_S
        self.what = what

    def wait(self, alive: Callable[[], None] | None) -> None:
        now = time.monotonic()
        if now >= self.next_check:
            self.next_check = now + CHECK_INTERVAL_S
            if alive is not None:
                alive()
            if self.deadline is not None and now >= self.deadline:
                raise TimeoutError(f"{self.what}: waited {now - self.start:.1f} s")
        if now < self.spin_until:
            os.sched_yield()
        else:
            time.sleep(self.sleep_s)
            self.sleep_s = min(self.sleep_s * 2, MAX_SLEEP_S)


class ShmBroadcastWriter:
    """The writing end: creates the segment; ``enqueue`` one message for every reader.

    ``overflow``: one connection per reader (reader ``i``'s at index ``i``) that carries
    the messages too long for a chunk; without it such a message is an error.
    """

    def __init__(
        self,
        n_readers: int,
        n_chunks: int = DEFAULT_N_CHUNKS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        overflow: Sequence[Connection] | None = None,
        spin_s: float = DEFAULT_SPIN_S,
    ) -> None:
        _check_shape(n_readers, n_chunks, chunk_bytes)
        if overflow is not None and len(overflow) != n_readers:
            raise ValueError(f"overflow: {len(overflow)} connections for {n_readers} readers")
        size = _Ring.segment_bytes(n_readers, n_chunks, chunk_bytes)
        # The segment is a sparse tmpfs file: only the pages messages touch use memory.
        shm = shared_memory.SharedMemory(create=True, size=size)
        self.handle = BroadcastHandle(shm.name, n_readers, n_chunks, chunk_bytes)
        self._ring = _Ring(self.handle, shm)
        self._ring.buf[: self._ring.data_start] = bytes(self._ring.data_start)
        self._overflow = list(overflow) if overflow is not None else None
        self._spin_s = spin_s
        self._next = 0
        self._closed = False
        #: Messages written, and of them those that went through the overflow path.
        self.n_enqueued = 0
        self.n_overflowed = 0

    @property
    def max_inline_bytes(self) -> int:
        """The longest message that travels inside a chunk."""
        return self.handle.chunk_bytes - _LENGTH.size

    def enqueue(
        self,
        data: bytes | bytearray | memoryview,
        timeout: float | None = None,
        alive: Callable[[list[int]], None] | None = None,
    ) -> None:
        """Publish ``data`` to every reader. Waits while the ring is full (the next chunk
        not yet read by every reader), calling ``alive(lagging_readers)`` every
        ``CHECK_INTERVAL_S`` (it raises to give up, e.g. for a dead reader) and raising
        ``TimeoutError`` after ``timeout`` seconds; an overflow connection that is closed
        raises ``ReaderGoneError`` naming its reader."""
        if self._closed:
            raise RuntimeError("enqueue() on a closed broadcast queue")
        ring = self._ring
        buf = ring.buf
        n = self.handle.n_readers
        chunk = self._next
        flags = ring.flags(chunk)
        waiter = _Waiter(self._spin_s, timeout, f"broadcast writer: ring full at chunk {chunk}")
        while buf[flags] and not all(buf[flags + 1 : flags + 1 + n]):
            waiter.wait(None if alive is None else lambda: alive(self._lagging(flags)))
        # Take the chunk back from the readers before touching its data.
        buf[flags] = 0
        buf[flags + 1 : flags + 1 + n] = bytes(n)
        start = ring.data(chunk)
        size = len(data)
        inline = size <= self.max_inline_bytes
        if inline:
            _LENGTH.pack_into(buf, start, size)
            buf[start + _LENGTH.size : start + _LENGTH.size + size] = data
        else:
            if self._overflow is None:
                raise ValueError(
                    f"message of {size} bytes > chunk_bytes - 8 = {self.max_inline_bytes} and no overflow connections"
                )
            _LENGTH.pack_into(buf, start, OVERFLOW)
        buf[flags] = 1  # publish
        self.n_enqueued += 1
        self._next = (chunk + 1) % self.handle.n_chunks
        if not inline:
            # After the marker: a reader takes the bytes from its connection when it
            # reaches this chunk, so the message keeps its place among the others.
            self.n_overflowed += 1
            for reader, conn in enumerate(self._overflow or ()):
                try:
                    conn.send_bytes(data)
                except (BrokenPipeError, ConnectionResetError, OSError) as e:
                    raise ReaderGoneError(reader, e) from None

    def _lagging(self, flags: int) -> list[int]:
        buf = self._ring.buf
        return [r for r in range(self.handle.n_readers) if not buf[flags + 1 + r]]

    def close(self) -> None:
        """Detach and unlink the segment (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._ring.release(unlink=True)
        del self._ring


class ShmBroadcastReader:
    """Reader ``reader`` of the queue ``handle`` names; ``overflow``: its connection for
    messages too long for a chunk (the writer's ``overflow[reader]``'s other end)."""

    def __init__(
        self,
        handle: BroadcastHandle,
        reader: int,
        overflow: Connection | None = None,
        spin_s: float = DEFAULT_SPIN_S,
    ) -> None:
        if not 0 <= reader < handle.n_readers:
            raise ValueError(f"reader={reader}: expected 0 <= reader < {handle.n_readers}")
        self.handle = handle
        self.reader = reader
        self._ring = _Ring(handle, shared_memory.SharedMemory(name=handle.name))
        self._overflow = overflow
        self._spin_s = spin_s
        self._next = 0
        self._closed = False

    def dequeue(
        self,
        timeout: float | None = None,
        alive: Callable[[], None] | None = None,
        decode: Callable[[memoryview], Any] = bytes,
    ) -> Any:
        """The next message, passed through ``decode`` (default: a copy as ``bytes``;
        e.g. ``pickle.loads`` reads the chunk in place, before it is handed back to the
        writer). Waits for it, calling ``alive()`` every ``CHECK_INTERVAL_S`` (it raises
        to give up) and raising ``TimeoutError`` after ``timeout`` seconds."""
        if self._closed:
            raise RuntimeError("dequeue() on a closed broadcast queue")
        ring = self._ring
        buf = ring.buf
        chunk = self._next
        flags = ring.flags(chunk)
        mine = flags + 1 + self.reader
        waiter = _Waiter(self._spin_s, timeout, f"broadcast reader {self.reader}: no message")
        # Own read byte first, then the written byte: the writer takes a chunk back by
        # clearing the written byte and then the read bytes. Read the other way round, a
        # reader back at a chunk it read a round ago could see the old round's written
        # byte, then its read byte just cleared, and read data still being written.
        while buf[mine] or not buf[flags]:
            waiter.wait(alive)
        start = ring.data(chunk)
        (size,) = _LENGTH.unpack_from(buf, start)
        if size == OVERFLOW:
            buf[mine] = 1  # the chunk holds nothing more for this reader
            self._next = (chunk + 1) % self.handle.n_chunks
            if self._overflow is None:
                raise RuntimeError("an overflow message arrived and this reader has no overflow connection")
            return decode(memoryview(self._overflow.recv_bytes()))
        view = buf[start + _LENGTH.size : start + _LENGTH.size + size]
        try:
            value = decode(view)
        finally:
            view.release()
            buf[mine] = 1
            self._next = (chunk + 1) % self.handle.n_chunks
        return value

    def close(self, unlink: bool = False) -> None:
        """Detach; ``unlink``: also remove the segment, for a reader that outlived its
        writer (the writer unlinks it otherwise; a segment already gone is fine)."""
        if self._closed:
            return
        self._closed = True
        self._ring.release(unlink)
        del self._ring

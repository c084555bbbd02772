"""The shared-memory broadcast queue alone (``kvloom.distributed.shm_broadcast``).

* every reader gets every message, in order, across ring wrap-arounds, from another
  process, with messages longer than a chunk going through the overflow connections;
* a full ring makes the writer wait, reporting the readers it waits for, and time out;
* a dead reader does not hang the writer (its ``alive`` hook or its closed connection);
* an idle reader times out or gives up through its ``alive`` hook;
* ``close()`` unlinks the segment; bad shapes are refused naming the field.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
import threading
import time
from multiprocessing.connection import Connection

import pytest

from kvloom.distributed.shm_broadcast import (
    BroadcastHandle,
    ReaderGoneError,
    ShmBroadcastReader,
    ShmBroadcastWriter,
)

SPAWN = multiprocessing.get_context("spawn")


def _message(i: int) -> bytes:
    # Sizes from empty to several chunks (chunk_bytes=256 below): inline and overflow.
    return pickle.dumps((i, bytes([i % 251]) * ((i * 37) % 900)))


def _read_all(handle: BroadcastHandle, reader: int, overflow: Connection, count: int, results: Connection) -> None:
    """A reader process: read ``count`` messages, send back their digest and sizes."""
    queue = ShmBroadcastReader(handle, reader, overflow)
    digest = hashlib.sha256()
    sizes = []
    for _ in range(count):
        data = queue.dequeue(timeout=60)
        digest.update(data)
        sizes.append(len(data))
    queue.close()
    results.send((digest.hexdigest(), sizes))


def _read_forever(handle: BroadcastHandle, reader: int, overflow: Connection) -> None:
    queue = ShmBroadcastReader(handle, reader, overflow)
    while True:
        queue.dequeue()


def _segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_readers_in_other_processes_get_every_message_in_order() -> None:
    count, n_readers = 400, 3
    pipes = [SPAWN.Pipe() for _ in range(n_readers)]
    results = [SPAWN.Pipe(duplex=False) for _ in range(n_readers)]
    writer = ShmBroadcastWriter(n_readers, n_chunks=4, chunk_bytes=256, overflow=[p[0] for p in pipes])
    procs = [
        SPAWN.Process(target=_read_all, args=(writer.handle, r, pipes[r][1], count, results[r][1]), daemon=True)
        for r in range(n_readers)
    ]
    for p in procs:
        p.start()
    try:
        expected = hashlib.sha256()
        for i in range(count):
            data = _message(i)
            expected.update(data)
            writer.enqueue(data, timeout=60)
        # 400 messages through 4 chunks: the ring wrapped 100 times; some went through overflow.
        assert 0 < writer.n_overflowed < count
        for r in range(n_readers):
            assert results[r][0].poll(60)
            digest, sizes = results[r][0].recv()
            assert digest == expected.hexdigest()
            assert sizes == [len(_message(i)) for i in range(count)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        writer.close()


def test_threads_wrap_around_with_decode_in_place() -> None:
    writer = ShmBroadcastWriter(2, n_chunks=2, chunk_bytes=128)
    readers = [ShmBroadcastReader(writer.handle, r) for r in range(2)]
    got: list[list[object]] = [[], []]

    def read(r: int) -> None:
        for _ in range(50):
            got[r].append(readers[r].dequeue(timeout=30, decode=pickle.loads))

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for i in range(50):
        writer.enqueue(pickle.dumps(("call", i)), timeout=30)
    for t in threads:
        t.join(timeout=30)
    assert got[0] == got[1] == [("call", i) for i in range(50)]
    for reader in readers:
        reader.close()
    writer.close()


class _WriterTakesBackOnFirstLook:
    """The ring's buffer as one reader sees it, with the writer taking chunk 0 back (its
    first two stores: the written byte, then the read bytes) right after the reader first
    loads chunk 0's written byte: the interleaving that let a reader read data still
    being written (seen in CI as a corrupted message)."""

    def __init__(self, buf: memoryview, written: int, n_readers: int) -> None:
        self.buf, self.written, self.n_readers, self.fired = buf, written, n_readers, False

    def __getitem__(self, index: object) -> object:
        value = self.buf[index]
        if index == self.written and not self.fired:
            self.fired = True
            self.buf[self.written] = 0
            self.buf[self.written + 1 : self.written + 1 + self.n_readers] = bytes(self.n_readers)
        return value

    def __setitem__(self, index: object, value: object) -> None:
        self.buf[index] = value


def test_a_reader_back_at_a_chunk_waits_for_the_new_round_to_be_published() -> None:
    writer = ShmBroadcastWriter(1, n_chunks=2, chunk_bytes=64)
    reader = ShmBroadcastReader(writer.handle, 0)
    try:
        for i in range(2):  # a full round: both chunks written and read
            writer.enqueue(bytes([i]))
            assert reader.dequeue(timeout=5) == bytes([i])
        # Back at chunk 0: written and read a round ago. The writer starts the next round
        # there; its data are not published (written byte 0) when the reader looks again.
        ring = reader._ring
        ring.buf = _WriterTakesBackOnFirstLook(ring.buf, ring.flags(0), 1)  # type: ignore[assignment]
        with pytest.raises(TimeoutError, match="broadcast reader 0: no message"):
            reader.dequeue(timeout=0.2)
    finally:
        reader._ring.buf = reader._ring.shm.buf
        reader.close()
        writer.close()


def test_full_ring_waits_reports_the_lagging_reader_and_times_out() -> None:
    writer = ShmBroadcastWriter(2, n_chunks=2, chunk_bytes=64)
    readers = [ShmBroadcastReader(writer.handle, r) for r in range(2)]
    writer.enqueue(b"a")
    writer.enqueue(b"b")
    assert readers[1].dequeue() == b"a"  # reader 0 reads nothing: chunk 0 stays taken
    lagging: list[list[int]] = []
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="ring full"):
        writer.enqueue(b"c", timeout=0.3, alive=lagging.append)
    assert 0.25 < time.monotonic() - start < 5
    assert lagging and all(r == [0] for r in lagging)
    # Once reader 0 catches up the writer goes on, and nothing was lost or reordered.
    assert readers[0].dequeue() == b"a"
    writer.enqueue(b"c", timeout=5)
    assert [readers[0].dequeue(), readers[0].dequeue()] == [b"b", b"c"]
    assert [readers[1].dequeue(), readers[1].dequeue()] == [b"b", b"c"]
    for reader in readers:
        reader.close()
    writer.close()


def test_dead_reader_does_not_hang_the_writer() -> None:
    parent_end, child_end = SPAWN.Pipe()
    writer = ShmBroadcastWriter(1, n_chunks=2, chunk_bytes=64, overflow=[parent_end])
    proc = SPAWN.Process(target=_read_forever, args=(writer.handle, 0, child_end), daemon=True)
    proc.start()
    child_end.close()
    try:
        writer.enqueue(b"x", timeout=30)
        proc.kill()
        proc.join(timeout=30)

        class ReaderDied(Exception):
            pass

        def alive(lagging: list[int]) -> None:
            if proc.exitcode is not None:
                raise ReaderDied(lagging)

        start = time.monotonic()
        with pytest.raises(ReaderDied):
            for _ in range(3):  # the ring has room for at most two: the third waits
                writer.enqueue(b"y", alive=alive)
        assert time.monotonic() - start < 5
    finally:
        if proc.is_alive():
            proc.kill()
        writer.close()


def test_overflow_to_a_closed_connection_names_the_reader() -> None:
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    writer = ShmBroadcastWriter(2, n_chunks=4, chunk_bytes=64, overflow=[p[0] for p in pipes])
    pipes[1][1].close()  # reader 1's end is gone
    with pytest.raises(ReaderGoneError, match="reader 1") as info:
        writer.enqueue(b"z" * 1000)
    assert info.value.reader == 1
    writer.close()


def test_long_message_without_overflow_connections_is_refused() -> None:
    writer = ShmBroadcastWriter(1, n_chunks=2, chunk_bytes=64)
    with pytest.raises(ValueError, match="56"):
        writer.enqueue(b"z" * 57)
    writer.close()


def test_idle_reader_times_out_or_gives_up_through_alive() -> None:
    writer = ShmBroadcastWriter(1, n_chunks=2, chunk_bytes=64)
    reader = ShmBroadcastReader(writer.handle, 0)
    with pytest.raises(TimeoutError, match="no message"):
        reader.dequeue(timeout=0.2)

    def writer_gone() -> None:
        raise EOFError("writer gone")

    with pytest.raises(EOFError):
        reader.dequeue(alive=writer_gone)
    # An idle reader sleeps: its CPU time stays well under the wall time it waited.
    cpu = time.process_time()
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.5)
    assert time.process_time() - cpu < 0.25
    reader.close()
    writer.close()


def test_close_unlinks_the_segment() -> None:
    writer = ShmBroadcastWriter(2, n_chunks=3, chunk_bytes=1024)
    name = writer.handle.name
    reader = ShmBroadcastReader(writer.handle, 0)
    assert _segment_exists(name)
    reader.close()
    assert _segment_exists(name)  # a reader never unlinks
    writer.close()
    writer.close()  # idempotent
    assert not _segment_exists(name)
    with pytest.raises(FileNotFoundError):
        ShmBroadcastReader(writer.handle, 1)
    with pytest.raises(RuntimeError, match="closed"):
        writer.enqueue(b"late")


def test_a_reader_that_outlived_the_writer_unlinks() -> None:
    writer = ShmBroadcastWriter(1, n_chunks=2, chunk_bytes=64)
    reader = ShmBroadcastReader(writer.handle, 0)
    name = writer.handle.name
    reader.close(unlink=True)
    assert not _segment_exists(name)
    writer.close()  # the segment already gone is fine


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_readers": 0}, "n_readers=0"),
        ({"n_readers": 1, "n_chunks": 1}, "n_chunks=1"),
        ({"n_readers": 1, "chunk_bytes": 8}, "chunk_bytes=8"),
    ],
)
def test_bad_shapes_are_refused_naming_the_field(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShmBroadcastWriter(**kwargs)


def test_bad_reader_index_is_refused() -> None:
    writer = ShmBroadcastWriter(2, n_chunks=2, chunk_bytes=64)
    with pytest.raises(ValueError, match="reader=2"):
        ShmBroadcastReader(writer.handle, 2)
    writer.close()

"""``kvloom bench serve``'s HTTP client against a raw asyncio server that answers as scripted:
chunked bodies whose lines straddle chunks, Content-Length and read-to-close bodies,
keep-alive reuse, error statuses, and the failures it must name instead of hanging."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from kvloom.entrypoints.cli.bench_http import BenchHTTPClient, HTTPError

Answer = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]  # request head+body -> keep the connection?


def replying(reply: bytes) -> Answer:
    """An answer that writes ``reply`` to every request and keeps the connection."""

    async def answer(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(reply)
        await writer.drain()
        return True

    return answer


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def serve(answer: Answer, work: Callable[[BenchHTTPClient, list[bytes]], Awaitable[None]],
                requests_per_connection: int = 0) -> int:  # fmt: skip
    """Runs ``work`` against a server that reads one request at a time and lets ``answer``
    write the response; returns how many connections the client opened. With
    ``requests_per_connection`` N, a connection's request N+1 is read and left unanswered
    (the connection closed), as a server closes an idle keep-alive connection."""
    requests: list[bytes] = []
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                request = head + await reader.readexactly(length)
                if served == requests_per_connection > 0:
                    break
                served += 1
                requests.append(request)
                if not await answer(request, writer):
                    break
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, BenchHTTPClient(f"http://127.0.0.1:{port}/base", {"Authorization": "Bearer k"}, 5.0) as client:
        await work(client, requests)
    return connections


def test_streamed_lines_across_chunks_and_keep_alive() -> None:
    events = [b"data: " + json.dumps({"n": i}).encode() + b"\n\n" for i in range(5)]
    stream = b"".join(events) + b"data: [DONE]\n\n"
    # split at awkward places: inside a line, between "\r" and "\n" of nothing, one byte pieces
    pieces = [stream[:7], stream[7:8], stream[8:30], stream[30:31], stream[31:]]

    answer = replying(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                      + chunked(*pieces))  # fmt: skip

    async def work(client: BenchHTTPClient, requests: list[bytes]) -> None:
        for _ in range(3):  # one connection serves all three
            async with client.stream("/v1/completions", {"prompt": "x"}) as (response, lines):
                assert response.status == 200 and response.headers["content-type"] == "text/event-stream"
                got = [line async for line in lines]
            assert got == [f'data: {{"n": {i}}}' if j == 0 else "" for i in range(5) for j in (0, 1)] + [
                "data: [DONE]", ""]  # fmt: skip
        head, _, body = requests[0].partition(b"\r\n\r\n")
        assert head.startswith(b"POST /base/v1/completions HTTP/1.1\r\n")
        assert b"\r\nauthorization: Bearer k" in head and b"\r\ncontent-type: application/json" in head
        assert json.loads(body) == {"prompt": "x"}

    assert asyncio.run(serve(answer, work)) == 1


def test_a_kept_alive_connection_the_server_closed_is_replaced() -> None:
    async def work(client: BenchHTTPClient, requests: list[bytes]) -> None:
        for _ in range(3):  # the 2nd and 3rd find their pooled connection closed unanswered
            assert (await client.get("/health")).text == "ok"
        assert len(requests) == 3

    ok = replying(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    assert asyncio.run(serve(ok, work, requests_per_connection=1)) == 3


def test_content_length_error_status_and_connection_close() -> None:
    async def answer(request: bytes, writer: asyncio.StreamWriter) -> bool:
        if request.startswith(b"GET /base/v1/models"):
            body = json.dumps({"data": [{"id": "m"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            return True
        if request.startswith(b"POST /base/bad"):
            writer.write(b'HTTP/1.1 400 Bad Request\r\ncontent-length: 19\r\n\r\n{"error": "max_tok"}'[:-1])
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nline one\nline two")  # no length: read to close
        await writer.drain()
        return False

    async def work(client: BenchHTTPClient, requests: list[bytes]) -> None:
        models = await client.get("/v1/models")
        assert models.status == 200 and models.json()["data"][0]["id"] == "m"
        bad = await client.post("/bad", {"max_tokens": -1})
        assert bad.status == 400 and bad.text == '{"error": "max_tok"'
        with pytest.raises(HTTPError, match="HTTP 400"):
            bad.raise_for_status()
        async with client.stream("/close", {}) as (response, lines):
            assert [line async for line in lines] == ["line one", "line two"]
        assert (await client.get("/v1/models")).status == 200  # a new connection after the close

    assert asyncio.run(serve(answer, work)) == 2


@pytest.mark.parametrize(
    "reply, match",
    [
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab", "IncompleteReadError"),  # closed mid-chunk
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "ValueError"),  # not a chunk size
        (b"SMTP ready\r\n\r\n", "not an HTTP/1.x status line"),
        (None, "no complete answer within 0.2 s"),  # never answers
    ],
)
def test_broken_answers_are_named_errors(reply: bytes | None, match: str) -> None:
    async def answer(request: bytes, writer: asyncio.StreamWriter) -> bool:
        if reply is None:
            await asyncio.sleep(10)
        writer.write(reply or b"")
        await writer.drain()
        return False

    async def work(client: BenchHTTPClient, requests: list[bytes]) -> None:
        client.timeout = 0.2
        with pytest.raises(HTTPError, match=match):
            async with client.stream("/v1/completions", {}) as (_, lines):
                [line async for line in lines]

    asyncio.run(serve(answer, work))


def test_a_callers_error_passes_through_and_the_url_is_checked() -> None:
    async def work(client: BenchHTTPClient, requests: list[bytes]) -> None:
        with pytest.raises(json.JSONDecodeError):  # the caller's own ValueError, not an HTTPError
            async with client.stream("/v1/completions", {}) as (_, lines):
                async for line in lines:
                    json.loads(line)

    asyncio.run(serve(replying(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nno"), work))
    with pytest.raises(ValueError, match="expected http://HOST"):
        BenchHTTPClient("localhost:8000")
    assert BenchHTTPClient("https://example.com").port == 443

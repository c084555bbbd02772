"""The HTTP client of ``kvloom bench serve``: HTTP/1.1 over asyncio streams, keep-alive
connections pooled, response bodies read as they arrive (``Content-Length``, chunked, or to
the end of the connection).

Why not httpx: a benchmark client must read faster than the server can write, or it
measures itself. httpx (with h11 parsing every chunk in Python) read at most 12-15k stream
events a second on the 2-core CI machine, while one 0.6B model on an H200 sends 15k;
``kvloom bench serve`` read 28-29% below ``vllm bench serve`` (aiohttp) on both engines'
servers (``docs/benchmarks/peers_h200.md``). This client reads ~4x as many events a second
on the same machine (``docs/benchmarks/bench_client_cpu.md``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Self
from urllib.parse import urlsplit

__all__ = ["BenchHTTPClient", "HTTPError", "Response"]


class HTTPError(Exception):
    """The server broke the protocol, closed the connection early, or did not answer in time."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    content: bytes = b""

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)

    def raise_for_status(self) -> None:
        if self.status >= 400:
            raise HTTPError(f"HTTP {self.status}: {self.text[:200]}")


@contextmanager
def _protocol_errors() -> Iterator[None]:
    """A broken or early-closed connection or a malformed response as one HTTPError (only
    around this client's own reads and writes: a caller's errors pass through as they are)."""
    try:
        yield
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        raise HTTPError(f"{type(exc).__name__}: {exc}") from exc


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reusable: bool = field(default=False)


class BenchHTTPClient:
    """``async with BenchHTTPClient("http://host:port") as client``: ``await client.get(path)``,
    ``await client.post(path, json_body)`` and ``async with client.stream(path, json_body) as
    (response, lines)`` for a streamed POST whose body arrives line by line (server-sent
    events). ``timeout`` bounds each request from its first byte sent to its last read."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout: float = 600.0) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base URL {base_url!r}: expected http://HOST[:PORT] or https://HOST[:PORT]")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.prefix = url.path.rstrip("/")
        self.headers = {"host": url.netloc, "accept": "*/*", **{k.lower(): v for k, v in (headers or {}).items()}}
        self.timeout = timeout
        self._idle: list[_Connection] = []

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.writer.close()

    async def get(self, path: str) -> Response:
        return await self._whole("GET", path, None)

    async def post(self, path: str, body: Any) -> Response:
        return await self._whole("POST", path, body)

    async def _whole(self, method: str, path: str, body: Any) -> Response:
        async with self._exchange(method, path, body) as (response, conn):
            response.content = b"".join([piece async for piece in self._body(response, conn)])
        return response

    @asynccontextmanager
    async def stream(self, path: str, body: Any) -> AsyncIterator[tuple[Response, AsyncIterator[str]]]:
        """POST ``body`` as JSON; yields the response (status and headers) and its body's lines
        (without line ends) as they arrive."""
        async with self._exchange("POST", path, body) as (response, conn):
            yield response, self._lines(self._body(response, conn))

    @asynccontextmanager
    async def _exchange(self, method: str, path: str, body: Any) -> AsyncIterator[tuple[Response, _Connection]]:
        """Send one request on an idle or new connection and read the response head; the
        connection goes back to the pool only when its body was read to the end."""
        payload = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {self.prefix}{path} HTTP/1.1", *(f"{k}: {v}" for k, v in self.headers.items())]
        if body is not None:
            head += ["content-type: application/json", f"content-length: {len(payload)}"]
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + payload
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self.timeout):
                response, conn = await self._send(request)
                yield response, conn
        except TimeoutError as exc:
            raise HTTPError(f"no complete answer within {self.timeout:g} s") from exc
        finally:
            if conn is not None:
                if conn.reusable:
                    conn.reusable = False
                    self._idle.append(conn)
                else:
                    conn.writer.close()

    async def _send(self, request: bytes) -> tuple[Response, _Connection]:
        """``request`` on an idle connection, or a new one; the response's head. A server
        may close an idle keep-alive connection at any time (uvicorn after 5 s): a reused
        connection that fails before answering is closed and the request sent once more on a
        new one, as httpx does."""
        while True:
            conn = self._idle.pop() if self._idle else None
            reused = conn is not None and not conn.reader.at_eof()
            with _protocol_errors():
                if not reused:
                    if conn is not None:
                        conn.writer.close()
                    conn = _Connection(*await asyncio.open_connection(self.host, self.port, ssl=self.ssl))
                assert conn is not None
                try:
                    conn.writer.write(request)
                    return await self._head(conn), conn
                except BaseException as exc:
                    conn.writer.close()
                    unanswered = isinstance(exc, ConnectionError) or (
                        isinstance(exc, asyncio.IncompleteReadError) and not exc.partial)
                    if not (reused and unanswered):
                        raise

    @staticmethod
    async def _head(conn: _Connection) -> Response:
        lines = (await conn.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HTTPError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return Response(int(parts[1]), headers)

    @staticmethod
    async def _body(response: Response, conn: _Connection) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; marks the connection reusable once it is all read."""
        reader, headers = conn.reader, response.headers
        keep_alive = headers.get("connection", "").lower() != "close"
        with _protocol_errors():
            if "chunked" in headers.get("transfer-encoding", "").lower():
                while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                    piece = await reader.readexactly(size + 2)
                    yield piece[:-2]
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the empty line
                    pass
            elif "content-length" in headers:
                piece = await reader.readexactly(int(headers["content-length"]))
                yield piece
            else:
                keep_alive = False
                while piece := await reader.read(65536):
                    yield piece
        conn.reusable = keep_alive

    @staticmethod
    async def _lines(pieces: AsyncIterator[bytes]) -> AsyncIterator[str]:
        rest = b""
        async for piece in pieces:
            *lines, rest = (rest + piece).split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if rest:
            yield rest.rstrip(b"\r").decode()

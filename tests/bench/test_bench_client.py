"""The bench's lean HTTP client (kvroute.bench.client + kvroute.bench.wire) against scripted
raw-socket servers: every response shape it must read, and every failure it must record."""

from __future__ import annotations

import asyncio
import gc
import re
import shutil
import ssl
import subprocess

import pytest

from kvroute.bench.client import BenchClient, run_closed_loop, run_open_loop
from kvroute.bench.prompts import BenchRequest
from kvroute.errors import UserError

BODY = b'{"model":"m","prompt":[1,2,3],"max_tokens":2,"stream":true}'


def request(index: int = 0, path: str = "/v1/completions") -> BenchRequest:
    return BenchRequest(index=index, prefix_id=0, session_id=None, prompt_tokens=3, output_tokens=2,
                        path=path, body=BODY)


def event(text: str | None = None, usage: bool = False) -> bytes:
    if usage:
        return (b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,'
                b'"prompt_tokens_details":{"cached_tokens":2}}}\n\n')
    return b'data: {"choices":[{"index":0,"text":"%s"}]}\n\n' % text.encode()


STREAM = event("a") + event("b") + event(usage=True) + b"data: [DONE]\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class ScriptedServer:
    """Reads each request (head + Content-Length body), remembers it, and answers with
    ``script(writer)``; counts accepted connections."""

    def __init__(self, script, ssl_context: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.ssl_context = ssl_context
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> ScriptedServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ssl_context)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                self.requests.append((head, await reader.readexactly(length)))
                if await self.script(writer) == "close" or b"connection: close" in head.lower():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def chunked_sse(pieces: list[bytes], headers: bytes = b"", pause: float = 0.0):
    async def script(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     + headers + b"\r\n")
        for piece in pieces:
            writer.write(chunk(piece))
            await writer.drain()
            if pause:
                await asyncio.sleep(pause)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return script


async def send(url: str, **kw):
    async with BenchClient(url, **kw) as client:
        return await client.send(request(), 0.0)


def assert_complete(record) -> None:
    assert record.ok, record.error
    assert record.status == 200
    assert record.output_tokens == 2 and record.cached_tokens == 2 and record.prompt_tokens == 3
    assert record.ttft_s > 0 and record.e2e_s >= record.ttft_s


# -- response shapes ---------------------------------------------------------------------------


async def test_chunked_stream_with_worker_header_and_request_framing():
    async with ScriptedServer(chunked_sse([STREAM], headers=b"X-Kvroute-Worker: w-3\r\n")) as server:
        url = server.url
        record = await send(url + "/team/")
    assert_complete(record)
    assert record.worker == "w-3"
    head, body = server.requests[0]
    assert body == BODY
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /team/v1/completions HTTP/1.1"  # the URL's path prefix is kept
    assert f"Host: {url.removeprefix('http://')}" in lines
    assert "Content-Type: application/json" in lines and "Connection: close" in lines
    assert f"Content-Length: {len(BODY)}" in lines


async def test_content_length_body():
    async def script(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(STREAM), STREAM))

    async with ScriptedServer(script) as server:
        assert_complete(await send(server.url))


async def test_body_delimited_by_close_and_last_line_without_newline():
    async def script(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + STREAM.rstrip(b"\n"))
        return "close"

    async with ScriptedServer(script) as server:
        assert_complete(await send(server.url))


async def test_sse_lines_split_across_reads_and_crlf_line_ends():
    crlf = STREAM.replace(b"\n", b"\r\n")
    cuts = [5, 30, 31, len(event("a")) + 1, len(crlf) - 4]  # inside "data:", between \r and \n
    pieces = [crlf[a:b] for a, b in zip([0, *cuts], [*cuts, len(crlf)])]
    async with ScriptedServer(chunked_sse(pieces, pause=0.01)) as server:
        record = await send(server.url)
    assert_complete(record)
    assert len(record.itl_s) == 1 and record.itl_s[0] > 0.005  # "a" and "b" came in separate reads


async def test_events_before_content_do_not_start_ttft():
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    async with ScriptedServer(chunked_sse([role, STREAM], pause=0.05)) as server:
        record = await send(server.url)
    assert_complete(record)
    assert record.ttft_s >= 0.04


async def test_error_status_keeps_the_message():
    async def script(writer):
        body = b'{"error":{"message":"max_tokens is too large","code":400}}'
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\nX-Kvroute-Worker: w-1\r\n\r\n%s"
                     % (len(body), body))

    async with ScriptedServer(script) as server:
        record = await send(server.url)
    assert (record.status, record.ok, record.ttft_s, record.e2e_s) == (400, False, None, None)
    assert record.error == "HTTP 400: max_tokens is too large" and record.worker == "w-1"


async def test_error_status_with_a_plain_chunked_body():
    async def script(writer):
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunk(b"overloaded") + b"0\r\n\r\n")

    async with ScriptedServer(script) as server:
        record = await send(server.url)
    assert record.status == 503 and record.error == "HTTP 503: overloaded"


async def test_error_event_inside_the_stream():
    async with ScriptedServer(chunked_sse([b'data: {"error":{"message":"boom"}}\n\n'])) as server:
        record = await send(server.url)
    assert record.status == 200 and not record.ok and record.error == "boom"


async def test_text_that_is_not_utf8_is_a_failed_record_not_a_crash():
    async with ScriptedServer(chunked_sse([b'data: {"choices":[{"index":0,"text":"\x80"}]}\n\n'])) as server:
        record = await send(server.url)
    assert not record.ok and record.error.startswith("unparsable stream chunk")

    async def script(writer):
        body = b'{"error":{"message":"\x80"}}'
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    async with ScriptedServer(script) as server:
        record = await send(server.url)
    assert record.status == 400 and record.error.startswith("HTTP 400: ")


async def test_stream_that_ends_without_done():
    async with ScriptedServer(chunked_sse([event("a")])) as server:
        record = await send(server.url)
    assert not record.ok and record.error == "stream ended without [DONE]"
    assert record.output_tokens == 1


# -- failures are records, never exceptions ----------------------------------------------------


async def test_connection_refused_is_a_failed_record():
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    record = await send(f"http://127.0.0.1:{port}")
    assert record.status == 0 and not record.ok
    assert record.error.startswith(f"cannot connect to 127.0.0.1:{port}") and "refused" in record.error.lower()


async def test_timeout_before_the_headers_and_the_task_stays_usable():
    async def script(writer):
        await asyncio.sleep(5)

    async with ScriptedServer(script) as server, BenchClient(server.url, timeout_s=0.2) as client:
        record = await client.send(request(), 0.0)
        await asyncio.sleep(0.01)  # the timeout's cancellation was absorbed, not pending
        assert asyncio.current_task().cancelling() == 0
    assert record.status == 0 and record.error == "timed out after 0.2 s"


async def test_timeout_in_the_middle_of_a_stream():
    async def script(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(event("a")))
        await writer.drain()
        await asyncio.sleep(5)

    async with ScriptedServer(script) as server:
        record = await send(server.url, timeout_s=0.3)
    assert record.status == 200 and record.error == "timed out after 0.3 s"
    assert record.ttft_s is not None and record.output_tokens == 1


async def test_server_closing_mid_stream():
    async def script(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(event("a")) + chunk(event("b")))
        await writer.drain()
        return "close"

    async with ScriptedServer(script) as server:
        record = await send(server.url)
    assert record.status == 200 and not record.ok
    assert record.error.startswith("server closed the connection before the response ended")
    assert record.output_tokens == 2


async def test_garbage_instead_of_http():
    async def script(writer):
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        return "close"

    async with ScriptedServer(script) as server:
        record = await send(server.url)
    assert record.status == 0 and record.error.startswith("invalid HTTP response")


async def test_outside_cancellation_propagates():
    async def script(writer):
        await asyncio.sleep(5)

    async with ScriptedServer(script) as server, BenchClient(server.url) as client:
        task = asyncio.create_task(client.send(request(), 0.0))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_url_must_be_http():
    with pytest.raises(UserError):
        BenchClient("ftp://127.0.0.1:1")
    with pytest.raises(UserError):
        BenchClient("127.0.0.1:8000")
    with pytest.raises(UserError, match="--api-key"):  # refused, not silently dropped
        BenchClient("http://user:secret@127.0.0.1:8000")


async def test_api_key_is_sent_as_a_bearer_token():
    async with ScriptedServer(chunked_sse([STREAM])) as server:
        assert_complete(await send(server.url, api_key="sk-local"))
        assert_complete(await send(server.url))
    assert "Authorization: Bearer sk-local" in server.requests[0][0].decode().split("\r\n")
    assert b"authorization" not in server.requests[1][0].lower()
    with pytest.raises(UserError):
        BenchClient("http://127.0.0.1:1", api_key="a\r\nX-Injected: 1")


async def test_model_discovery_says_when_a_key_is_wanted_or_refused(serve_app):
    from aiohttp import web

    from kvroute.bench.runner import discover_model

    async def models(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer right":
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response({"data": [{"id": "tiny"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serve_app(app) as url:
        assert await discover_model(url, api_key="right") == "tiny"
        with pytest.raises(UserError, match="wants an API key"):
            await discover_model(url)
        with pytest.raises(UserError, match="refused the API key"):
            await discover_model(url, api_key="wrong")


# -- connections -------------------------------------------------------------------------------


@pytest.mark.parametrize("keep_alive, connections", [(False, 5), (True, 1)])
async def test_connection_per_request_unless_keep_alive(keep_alive, connections):
    # The terminator comes in a later write than [DONE]: a pooled connection must still be
    # read to the end of its message before it carries the next request.
    records = []
    async with ScriptedServer(chunked_sse([STREAM], pause=0.01)) as server, \
            BenchClient(server.url, keep_alive=keep_alive) as client:
        await run_closed_loop(client, [request(i) for i in range(5)], 1, records.append)
    assert all(r.ok for r in records)
    assert server.connections == connections
    assert all((b"connection: keep-alive" in head.lower()) == keep_alive for head, _ in server.requests)


async def test_open_loop_sends_concurrently_and_restores_the_collector():
    frozen = gc.get_freeze_count()
    async with ScriptedServer(chunked_sse([STREAM], pause=0.05)) as server, BenchClient(server.url) as client:
        records = []
        await run_open_loop(client, [request(i) for i in range(10)], [0.0] * 10, records.append)
    assert sorted(r.index for r in records) == list(range(10)) and all(r.ok for r in records)
    assert server.connections == 10
    assert max(r.e2e_s for r in records) < 0.5  # in parallel, not 10 × 50 ms one after another
    assert gc.get_freeze_count() == frozen


# -- TLS ---------------------------------------------------------------------------------------


@pytest.fixture
def localhost_cert(tmp_path):
    """A self-signed certificate for ``localhost`` (cert path, key path)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True,
    )
    return cert, key


async def test_https_verifies_the_certificate(localhost_cert, monkeypatch):
    cert, key = localhost_cert
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    async with ScriptedServer(chunked_sse([STREAM]), context) as server:
        url = server.url.replace("http://127.0.0.1", "https://localhost")
        untrusted = await send(url)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the default context's trust store
        trusted = await send(url)
    assert untrusted.status == 0 and "certificate verify failed" in untrusted.error.lower()
    assert_complete(trusted)

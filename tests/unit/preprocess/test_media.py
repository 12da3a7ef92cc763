"""http(s) image URLs: refused unless enabled and allow-listed by host and port (SSRF), no
credentials on any hop, size, time and redirect limits, and one uniform client-facing error
for every failed fetch (the log keeps the reason). The only server is a real one on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from epd_kit.preprocess import (
    Limits,
    Media,
    MediaFetchFailed,
    MediaFetchRefused,
)
from epd_kit.testing.images import encode_image, image_part, make_image, user_message

PNG = encode_image(make_image(96, 64, seed=2))


class _Server:
    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.authorization: list[str | None] = []
        self.cookies: list[str | None] = []
        self.stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:
                server.hits[self.path] += 1
                server.authorization.append(self.headers.get("Authorization"))
                server.cookies.append(self.headers.get("Cookie"))
                route = getattr(
                    server, "route_" + self.path.split("?")[0].strip("/").replace("-", "_").replace(".", "_"), None
                )
                if route is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                route(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        # the client hangs up on purpose in the size and deadline tests: not worth a traceback
        self.httpd.handle_error = lambda request, address: None  # type: ignore[method-assign]
        self.port = self.httpd.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: bytes, **headers: str) -> None:
        h.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)

    def route_img_png(self, h) -> None:
        self._send(h, 200, PNG, **{"Content-Type": "image/png"})

    def route_text(self, h) -> None:
        self._send(h, 200, b"this is not an image")

    def route_big(self, h) -> None:  # declares its size honestly
        self._send(h, 200, b"\0" * 50_000)

    def route_big_chunked(self, h) -> None:  # no Content-Length: the cap must apply while reading
        h.send_response(200)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for _ in range(20):
            h.wfile.write(b"1000\r\n" + b"\0" * 0x1000 + b"\r\n")
        h.wfile.write(b"0\r\n\r\n")

    def route_slow(self, h) -> None:  # headers at once, then a drip: per-phase timeouts never fire
        h.send_response(200)
        h.send_header("Content-Length", str(len(PNG)))
        h.end_headers()
        for byte in PNG[:40]:
            if self.stop.wait(0.1):
                return
            h.wfile.write(bytes([byte]))
            h.wfile.flush()

    def route_img_cookie_png(self, h) -> None:  # an image host that sets a session cookie
        self._send(h, 200, PNG, **{"Content-Type": "image/png", "Set-Cookie": "session=client-a; Path=/"})

    def route_redirect_same(self, h) -> None:
        self._send(h, 302, b"", Location="/img.png")

    def route_redirect_other(self, h) -> None:
        self._send(h, 302, b"", Location=f"http://localhost:{self.port}/img.png")

    def route_redirect_with_credentials(self, h) -> None:
        self._send(h, 302, b"", Location=f"http://user:pw@127.0.0.1:{self.port}/img.png")

    def route_redirect_loop(self, h) -> None:
        self._send(h, 302, b"", Location="/redirect-loop")

    def __enter__(self) -> _Server:
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    with _Server() as s:
        yield s


def _allowing(make_preprocessor, *hosts: str, timeout: float = 5.0, **limits: int):
    return make_preprocessor(
        media=Media(allow_http=True, allowed_hosts=list(hosts), fetch_timeout_s=timeout), limits=Limits(**limits)
    )


def _msg(url: str) -> list[dict]:
    return [user_message("look", image_part(url))]


def _reasons(caplog: pytest.LogCaptureFixture) -> str:
    """What the router logged about failed fetches (the client never sees it)."""
    return " | ".join(getattr(r, "reason", "") for r in caplog.records)


async def test_http_is_refused_by_default_without_any_connection(pre, server: _Server) -> None:
    before = server.hits["/img.png"]
    with pytest.raises(MediaFetchRefused, match=r"media\.allow_http: false"):
        await pre.render(_msg(server.base + "/img.png"))
    assert server.hits["/img.png"] == before


async def test_allow_listed_host_and_port_is_fetched(make_preprocessor, server: _Server) -> None:
    pre = _allowing(make_preprocessor, f"127.0.0.1:{server.port}")
    rendered = await pre.render(_msg(server.base + "/img.png"))
    assert rendered.items[0].grid_thw == (1, 14, 20)  # 96x64 grows past min_pixels to 320x224


async def test_a_host_entry_allows_only_the_default_port(make_preprocessor, server: _Server) -> None:
    """`host` alone means port 80 (http) / 443 (https): it must not open every port of the
    host to the fetcher (a port scanner)."""
    before = sum(server.hits.values())
    host_only = _allowing(make_preprocessor, "127.0.0.1")
    with pytest.raises(MediaFetchRefused, match=f"'127.0.0.1:{server.port}' is not in media.allowed_hosts"):
        await host_only.render(_msg(server.base + "/img.png"))
    wrong_port = _allowing(make_preprocessor, f"127.0.0.1:{server.port + 1}")
    with pytest.raises(MediaFetchRefused, match=r"not in media\.allowed_hosts"):
        await wrong_port.render(_msg(server.base + "/img.png"))
    assert sum(server.hits.values()) == before
    policy = Media(allowed_hosts=["Images.Example.org", "[::1]:8080", "h:8443"])
    assert policy.allows("images.example.org", 80, 80) and policy.allows("images.example.org", 443, 443)
    assert not policy.allows("images.example.org", 8080, 80)
    assert policy.allows("::1", 8080, 80) and not policy.allows("::1", 80, 80)
    assert policy.allows("h", 8443, 443) and not policy.allows("h", 443, 443)


@pytest.mark.parametrize("entry", ["::1", "[::1", "h:0", "h:x", ":80", "[]:1"])
def test_unusable_allow_list_entries_are_refused(entry: str) -> None:
    with pytest.raises(ValueError, match="allowed host"):
        Media(allowed_hosts=[entry])


async def test_unlisted_host_is_refused_before_connecting(make_preprocessor, server: _Server) -> None:
    pre = _allowing(make_preprocessor, "images.example.org")
    before = sum(server.hits.values())
    with pytest.raises(MediaFetchRefused, match=f"'127.0.0.1:{server.port}' is not in media.allowed_hosts"):
        await pre.render(_msg(server.base + "/img.png"))
    with pytest.raises(MediaFetchRefused, match="credentials"):
        await pre.render(_msg(f"http://user:pw@127.0.0.1:{server.port}/img.png"))
    assert sum(server.hits.values()) == before


async def test_redirects_only_within_the_origin_and_never_with_credentials(
    make_preprocessor, server: _Server, caplog: pytest.LogCaptureFixture
) -> None:
    pre = _allowing(make_preprocessor, f"127.0.0.1:{server.port}")
    assert len((await pre.render(_msg(server.base + "/redirect-same"))).items) == 1
    # a redirect that carries user:password is followed without them
    server.authorization.clear()
    assert len((await pre.render(_msg(server.base + "/redirect-with-credentials"))).items) == 1
    assert server.authorization == [None, None]
    before = server.hits["/img.png"]
    with pytest.raises(MediaFetchFailed, match="could not fetch an image"):
        await pre.render(_msg(server.base + "/redirect-other"))
    assert server.hits["/img.png"] == before  # the other host was never contacted
    assert "redirected to another origin" in _reasons(caplog)
    with pytest.raises(MediaFetchFailed, match="could not fetch an image"):
        await pre.render(_msg(server.base + "/redirect-loop"))
    assert "more than 3 redirects" in _reasons(caplog)


async def test_size_limit_by_header_and_while_streaming(
    make_preprocessor, server: _Server, caplog: pytest.LogCaptureFixture
) -> None:
    pre = _allowing(make_preprocessor, f"127.0.0.1:{server.port}", max_image_bytes=40_000)
    with pytest.raises(MediaFetchFailed, match="could not fetch an image"):
        await pre.render(_msg(server.base + "/big"))
    assert "declares 50000 bytes" in _reasons(caplog)
    with pytest.raises(MediaFetchFailed, match="could not fetch an image"):
        await pre.render(_msg(server.base + "/big-chunked"))
    assert "sent more than limits.max_image_bytes (40000)" in _reasons(caplog)


async def test_whole_fetch_deadline(make_preprocessor, server: _Server, caplog: pytest.LogCaptureFixture) -> None:
    pre = _allowing(make_preprocessor, f"127.0.0.1:{server.port}", timeout=0.5)
    start = time.monotonic()
    with pytest.raises(MediaFetchFailed, match="could not fetch an image"):
        await pre.render(_msg(server.base + "/slow"))
    assert time.monotonic() - start < 2.0
    assert "longer than 0.5s (media.fetch_timeout_s)" in _reasons(caplog)


async def test_every_fetch_failure_looks_the_same_to_the_client(
    make_preprocessor, server: _Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A closed port, an HTTP error, a body that is not an image and a redirect elsewhere
    give one message (with the client's own URL): the fetcher cannot map a network."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens once the socket is closed
    pre = _allowing(make_preprocessor, f"127.0.0.1:{server.port}", f"127.0.0.1:{closed}")
    urls = [
        f"http://127.0.0.1:{closed}/x",
        server.base + "/missing.png?token=secret",
        server.base + "/text",
        server.base + "/redirect-other",
    ]
    messages = set()
    for url in urls:
        with pytest.raises(MediaFetchFailed) as err:
            await pre.render(_msg(url))
        assert err.value.status == 400 and err.value.param == "messages[0].content[1]"
        assert "secret" not in err.value.message  # query strings may carry credentials
        messages.add(err.value.message.replace(url.split("?")[0], "URL"))
    assert messages == {"could not fetch an image from URL (the router's log has the reason)"}
    for reason in ("ConnectError", "answered HTTP 404", "not an image", "another origin"):
        assert reason in _reasons(caplog)


async def test_no_cookie_from_one_fetch_reaches_another(make_preprocessor, server: _Server) -> None:
    """A Set-Cookie answered to client A's fetch went out on client B's."""
    from epd_kit.preprocess.fairness import current_client

    pre = _allowing(make_preprocessor, f"127.0.0.1:{server.port}")
    current_client.set("client-a")
    await pre.render(_msg(f"{server.base}/img-cookie.png"))
    before = len(server.cookies)
    current_client.set("client-b")
    await pre.render(_msg(f"{server.base}/img.png?b"))
    await pre.render(_msg(f"{server.base}/img-cookie.png?again"))
    assert server.cookies[before:] == [None, None]

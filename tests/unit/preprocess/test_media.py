"""http(s) image URLs: refused unless enabled and allow-listed (SSRF), with size, time and
redirect limits. The only server is a real one on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from epd_kit.preprocess import (
    ImageTooLarge,
    Limits,
    Media,
    MediaFetchFailed,
    MediaFetchRefused,
    NotAnImage,
)
from epd_kit.testing.images import encode_image, image_part, make_image, user_message

PNG = encode_image(make_image(96, 64, seed=2))


class _Server:
    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server naming)
                server.hits[self.path] += 1
                route = getattr(server, "route_" + self.path.split("?")[0].strip("/").replace("-", "_").replace(".", "_"), None)
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

    def route_redirect_same(self, h) -> None:
        self._send(h, 302, b"", Location="/img.png")

    def route_redirect_other(self, h) -> None:
        self._send(h, 302, b"", Location=f"http://localhost:{self.port}/img.png")

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
        media=Media(allow_http=True, allowed_hosts=list(hosts), fetch_timeout_s=timeout),
        limits=Limits(**limits))


def _msg(url: str) -> list[dict]:
    return [user_message("look", image_part(url))]


async def test_http_is_refused_by_default_without_any_connection(pre, server: _Server) -> None:
    before = server.hits["/img.png"]
    with pytest.raises(MediaFetchRefused, match="media.allow_http: false"):
        await pre.render(_msg(server.base + "/img.png"))
    assert server.hits["/img.png"] == before


async def test_allow_listed_host_is_fetched(make_preprocessor, server: _Server) -> None:
    pre = _allowing(make_preprocessor, "127.0.0.1")
    rendered = await pre.render(_msg(server.base + "/img.png"))
    assert rendered.items[0].grid_thw == (1, 14, 20)  # 96x64 grows past min_pixels to 320x224


async def test_host_and_port_entries(make_preprocessor, server: _Server) -> None:
    ok = _allowing(make_preprocessor, f"127.0.0.1:{server.port}")
    assert len((await ok.render(_msg(server.base + "/img.png"))).items) == 1
    wrong_port = _allowing(make_preprocessor, f"127.0.0.1:{server.port + 1}")
    with pytest.raises(MediaFetchRefused, match="not in media.allowed_hosts"):
        await wrong_port.render(_msg(server.base + "/img.png"))


async def test_unlisted_host_is_refused_before_connecting(make_preprocessor, server: _Server) -> None:
    pre = _allowing(make_preprocessor, "images.example.org")
    before = sum(server.hits.values())
    with pytest.raises(MediaFetchRefused, match="'127.0.0.1' is not in media.allowed_hosts"):
        await pre.render(_msg(server.base + "/img.png"))
    with pytest.raises(MediaFetchRefused, match="credentials"):
        await pre.render(_msg(f"http://user:pw@127.0.0.1:{server.port}/img.png"))
    assert sum(server.hits.values()) == before


async def test_redirects_only_within_the_host(make_preprocessor, server: _Server) -> None:
    pre = _allowing(make_preprocessor, "127.0.0.1")
    assert len((await pre.render(_msg(server.base + "/redirect-same"))).items) == 1
    before = server.hits["/img.png"]
    with pytest.raises(MediaFetchRefused, match="redirects to another host"):
        await pre.render(_msg(server.base + "/redirect-other"))
    assert server.hits["/img.png"] == before  # the other host was never contacted
    with pytest.raises(MediaFetchFailed, match="more than 3 redirects"):
        await pre.render(_msg(server.base + "/redirect-loop"))


async def test_size_limit_by_header_and_while_streaming(make_preprocessor, server: _Server) -> None:
    pre = _allowing(make_preprocessor, "127.0.0.1", max_image_bytes=40_000)
    with pytest.raises(ImageTooLarge) as err:
        await pre.render(_msg(server.base + "/big"))
    assert err.value.status == 413 and "50000 bytes" in err.value.message
    with pytest.raises(ImageTooLarge, match="more than 40000 bytes"):
        await pre.render(_msg(server.base + "/big-chunked"))


async def test_whole_fetch_deadline(make_preprocessor, server: _Server) -> None:
    pre = _allowing(make_preprocessor, "127.0.0.1", timeout=0.5)
    start = time.monotonic()
    with pytest.raises(MediaFetchFailed, match=r"longer than 0.5s \(media.fetch_timeout_s\)"):
        await pre.render(_msg(server.base + "/slow"))
    assert time.monotonic() - start < 2.0


async def test_http_errors_and_non_images(make_preprocessor, server: _Server) -> None:
    pre = _allowing(make_preprocessor, "127.0.0.1")
    with pytest.raises(MediaFetchFailed, match="returned HTTP 404") as err:
        await pre.render(_msg(server.base + "/missing.png?token=secret"))
    assert "secret" not in err.value.message  # query strings may carry credentials
    assert err.value.param == "messages[0].content[1]"
    with pytest.raises(NotAnImage):
        await pre.render(_msg(server.base + "/text"))

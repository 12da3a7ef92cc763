"""Where image bytes come from: data: URLs always, http(s) only under the media policy.

The fetcher is deliberately narrow (SSRF guard): scheme http/https, host and port on the
allow-list (a host-only entry allows the scheme's default port only), no proxies from the
environment, no credentials on any hop (a redirect's user:password is dropped), redirects
followed by hand and only to the same scheme, host and port, the body streamed and cut at
max_image_bytes, and one deadline for the whole fetch (httpx's own timeouts are per phase,
so a slow drip would never trip them). Fetches share nothing a client could plant or read:
no cookie jar (a `Set-Cookie` answered to one client's fetch would go out on the next
client's), and no headers beyond httpx's defaults.

Every failure after the policy check (refused connection, timeout, HTTP status, redirect
elsewhere, oversize, a body that is not an image) reaches the client as the same message:
differing texts would let a client map which ports answer and what they serve. The log
keeps the reason.
"""

from __future__ import annotations

import asyncio
import binascii
import io
import logging
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

from .errors import ImageTooLarge, MalformedImageUrl, MediaFetchFailed, MediaFetchRefused
from .settings import Limits, Media

if TYPE_CHECKING:  # httpx (and the rich it imports) loads with the first http(s) image URL, not at start
    import httpx

try:  # SIMD base64 that releases the GIL: a 20 MB image must not stall the event loop
    from pybase64 import b64decode as _b64decode
except ImportError:  # pragma: no cover - same result, slower, holds the GIL
    from base64 import b64decode as _b64decode

log = logging.getLogger("epd_router.media")

_REDIRECTS = {301, 302, 303, 307, 308}
_DEFAULT_PORTS = {"http": 80, "https": 443}


def decode_data_url(url: str, limits: Limits, payload: bytes | memoryview | None = None) -> bytes:
    """The bytes of a base64 `data:image/...;base64,...` URL (size checked before decoding).
    `payload`: the base64 text when the router kept it apart from the URL (its request-body
    decoding lifts long payloads out, router/body.py); `url` then only supplies the header."""
    header, comma, text = url.partition(",")  # no regex over a multi-megabyte string
    if not comma or not header[:5].lower() == "data:":
        raise MalformedImageUrl("data: URL has no ',' separating the header from the data")
    mediatype, *params = (p.strip().lower() for p in header[5:].split(";"))
    if mediatype and not mediatype.startswith("image/"):
        raise MalformedImageUrl(f"data: URL media type {mediatype!r} is not an image type (image/...)")
    if "base64" not in params:
        raise MalformedImageUrl("data: URL must be base64 encoded (data:image/png;base64,...)")
    encoded: str | bytes | memoryview = text if payload is None else payload
    # 3 bytes per 4 characters: refuse oversize before spending time on decoding
    tail = encoded[-2:]
    approx = len(encoded) * 3 // 4 - (tail.count("=") if isinstance(tail, str) else bytes(tail).count(b"="))
    if approx > limits.max_image_bytes:
        raise ImageTooLarge(
            f"image is about {approx} bytes, above the limit of {limits.max_image_bytes} bytes (limits.max_image_bytes)"
        )
    try:
        data = _decode_base64(encoded)
    except (binascii.Error, ValueError) as exc:
        raise MalformedImageUrl(f"data: URL payload is not valid base64: {exc}") from exc
    if not data:
        raise MalformedImageUrl("data: URL carries no data")
    return data


def _decode_base64(encoded: str | bytes | memoryview) -> bytes:
    """Strict base64; whitespace (allowed in data: URLs) is dropped first, only if present."""
    try:
        return _b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raw = encoded.encode("ascii", "replace") if isinstance(encoded, str) else bytes(encoded)
        stripped = raw.translate(None, b" \t\r\n")
        if len(stripped) == len(raw):
            raise
        return _b64decode(stripped, validate=True)


class _FetchFailure(Exception):
    """Why one fetch failed, for the log only (the client gets the uniform message)."""


class MediaFetcher:
    """Fetches allowed http(s) image URLs. One httpx client, created on first use."""

    def __init__(self, policy: Media, limits: Limits) -> None:
        self.policy = policy
        self.limits = limits
        self._client: httpx.AsyncClient | None = None

    def check_allowed(self, url: str) -> httpx.URL:
        """Raise unless the policy allows fetching `url` (done before any network I/O)."""
        import httpx

        try:
            parsed = httpx.URL(url)
        except Exception as exc:
            raise MalformedImageUrl(f"image URL does not parse: {exc}") from exc
        if parsed.scheme not in _DEFAULT_PORTS:
            raise MalformedImageUrl(
                f"image URL scheme {parsed.scheme!r} is not supported; use a data: URL "
                "(data:image/png;base64,...) or an allowed http(s) URL"
            )
        if not self.policy.allow_http:
            raise MediaFetchRefused(
                "http(s) image URLs are disabled on this router (media.allow_http: false); "
                "send the image inline as a base64 data: URL"
            )
        if parsed.userinfo:
            raise MediaFetchRefused("image URLs with credentials (user@host) are refused")
        if not self._allowed(parsed):
            raise MediaFetchRefused(
                f"image host {_origin(parsed)!r} is not in media.allowed_hosts; send the image "
                "as a base64 data: URL or ask the operator to allow the host"
            )
        return parsed

    def _allowed(self, url: httpx.URL) -> bool:
        default = _DEFAULT_PORTS[url.scheme]
        return self.policy.allows(url.host or "", url.port or default, default)

    async def fetch(self, url: str) -> bytes:
        """The body at an allowed URL, or the one uniform `MediaFetchFailed`. The caller
        then runs `check_fetched_image` on it (in a worker thread: Pillow parses the header)."""
        import httpx

        target = self.check_allowed(url)
        timeout = self.policy.fetch_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await self._fetch_following(target)
        except TimeoutError:
            reason = f"took longer than {timeout}s (media.fetch_timeout_s)"
        except _FetchFailure as exc:
            reason = str(exc)
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        raise fetch_failed(url, reason)

    async def _fetch_following(self, target: httpx.URL) -> bytes:
        import httpx

        client = self._get_client()
        for _ in range(self.policy.max_redirects + 1):
            async with client.stream("GET", target) as response:
                if response.status_code in _REDIRECTS:
                    location = response.headers.get("location", "")
                    # never send credentials, whatever a redirect says
                    nxt = httpx.URL(urljoin(str(target), location)).copy_with(username=None, password=None)
                    if (nxt.scheme, nxt.host, nxt.port) != (target.scheme, target.host, target.port):
                        raise _FetchFailure(f"redirected to another origin ({_short(str(nxt))})")
                    target = nxt
                    continue
                if response.status_code != 200:
                    raise _FetchFailure(f"{_short(str(target))} answered HTTP {response.status_code}")
                return await self._read_limited(response, target)
        raise _FetchFailure(f"more than {self.policy.max_redirects} redirects (media.max_redirects)")

    async def _read_limited(self, response: httpx.Response, target: httpx.URL) -> bytes:
        limit = self.limits.max_image_bytes
        declared = response.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise _FetchFailure(
                f"{_short(str(target))} declares {declared} bytes, above limits.max_image_bytes ({limit})"
            )
        chunks: list[bytes] = []
        total = 0
        async for chunk in response.aiter_bytes():
            total += len(chunk)
            if total > limit:
                raise _FetchFailure(f"{_short(str(target))} sent more than limits.max_image_bytes ({limit})")
            chunks.append(chunk)
        return b"".join(chunks)

    def _get_client(self) -> httpx.AsyncClient:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(
                follow_redirects=False,
                trust_env=False,  # never route through an environment proxy
                cookies=_no_cookies(),
                timeout=httpx.Timeout(self.policy.fetch_timeout_s),
                limits=httpx.Limits(max_connections=32, max_keepalive_connections=8),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _no_cookies() -> CookieJar:
    """A jar whose policy allows no domain: nothing is stored, nothing is sent."""
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


def check_fetched_image(url: str, data: bytes, limits: Limits) -> bytes:
    """A fetched body must at least have the header of an allowed image format (read only,
    nothing decoded): a server that answers with something else is a failed fetch like any other."""
    from PIL import Image  # with the first fetched image, not at the router's start

    try:
        with Image.open(io.BytesIO(data), formats=limits.image_formats) as image:
            image.size  # noqa: B018 - the header parsed
    except Exception as exc:  # Pillow raises many types for unknown data
        raise fetch_failed(url, f"the body is not an image ({type(exc).__name__})") from None
    return data


def fetch_failed(url: str, reason: str) -> MediaFetchFailed:
    """The client's error for any failed fetch; the reason goes to the log only."""
    log.warning("image fetch failed", extra={"url": _short(url), "reason": reason})
    return MediaFetchFailed(f"could not fetch an image from {_short(url)} (the router's log has the reason)")


def _origin(url: httpx.URL) -> str:
    host = f"[{url.host}]" if ":" in (url.host or "") else url.host
    return f"{host}:{url.port}" if url.port else str(host)


def _short(url: str, keep: int = 120) -> str:
    """URLs in messages without credentials and query strings (they may carry tokens) and
    bounded in length."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    shown = f"{parts.scheme}://{netloc}{parts.path}"
    return shown if len(shown) <= keep else shown[:keep] + "..."

"""Where image bytes come from: data: URLs always, http(s) only under the media policy.

The fetcher is deliberately narrow (SSRF guard): scheme http/https, host on the allow-list
(exact name, or "host:port"), no proxies from the environment, redirects followed by hand
and only to the same host, the body streamed and cut at max_image_bytes, and one deadline
for the whole fetch (httpx's own timeouts are per phase, so a slow drip would never trip them).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from urllib.parse import urljoin, urlsplit

import httpx

from .errors import ImageTooLarge, MalformedImageUrl, MediaFetchFailed, MediaFetchRefused
from .settings import Limits, Media

_REDIRECTS = {301, 302, 303, 307, 308}


def decode_data_url(url: str, limits: Limits) -> bytes:
    """The bytes of a base64 `data:image/...;base64,...` URL (size checked before decoding)."""
    header, comma, payload = url.partition(",")  # no regex over a multi-megabyte string
    if not comma or not header[:5].lower() == "data:":
        raise MalformedImageUrl("data: URL has no ',' separating the header from the data")
    mediatype, *params = (p.strip().lower() for p in header[5:].split(";"))
    if mediatype and not mediatype.startswith("image/"):
        raise MalformedImageUrl(f"data: URL media type {mediatype!r} is not an image type (image/...)")
    if "base64" not in params:
        raise MalformedImageUrl("data: URL must be base64 encoded (data:image/png;base64,...)")
    if any(c in payload for c in " \t\r\n"):
        payload = re.sub(r"\s+", "", payload)
    # 3 bytes per 4 characters: refuse oversize before spending time on decoding
    approx = len(payload) * 3 // 4 - payload[-2:].count("=")
    if approx > limits.max_image_bytes:
        raise ImageTooLarge(
            f"image is about {approx} bytes, above the limit of {limits.max_image_bytes} bytes "
            "(limits.max_image_bytes)"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MalformedImageUrl(f"data: URL payload is not valid base64: {exc}") from exc
    if not data:
        raise MalformedImageUrl("data: URL carries no data")
    return data


def _host_allowed(url: httpx.URL, policy: Media) -> bool:
    host = (url.host or "").lower()
    port = url.port or (443 if url.scheme == "https" else 80)
    return host in policy.allowed_hosts or f"{host}:{port}" in policy.allowed_hosts


class MediaFetcher:
    """Fetches allowed http(s) image URLs. One httpx client, created on first use."""

    def __init__(self, policy: Media, limits: Limits) -> None:
        self.policy = policy
        self.limits = limits
        self._client: httpx.AsyncClient | None = None

    def check_allowed(self, url: str) -> httpx.URL:
        """Raise unless the policy allows fetching `url` (done before any network I/O)."""
        try:
            parsed = httpx.URL(url)
        except Exception as exc:
            raise MalformedImageUrl(f"image URL does not parse: {exc}") from exc
        if parsed.scheme not in ("http", "https"):
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
        if not _host_allowed(parsed, self.policy):
            raise MediaFetchRefused(
                f"image host {parsed.host!r} is not in media.allowed_hosts; send the image "
                "as a base64 data: URL or ask the operator to allow the host"
            )
        return parsed

    async def fetch(self, url: str) -> bytes:
        target = self.check_allowed(url)
        timeout = self.policy.fetch_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await self._fetch_following(target)
        except TimeoutError as exc:
            raise MediaFetchFailed(f"fetching {_short(url)} took longer than {timeout}s "
                                   "(media.fetch_timeout_s)") from exc
        except httpx.HTTPError as exc:
            raise MediaFetchFailed(f"fetching {_short(url)} failed: {type(exc).__name__}: {exc}") from exc

    async def _fetch_following(self, target: httpx.URL) -> bytes:
        client = self._get_client()
        for _ in range(self.policy.max_redirects + 1):
            async with client.stream("GET", target) as response:
                if response.status_code in _REDIRECTS:
                    location = response.headers.get("location", "")
                    nxt = httpx.URL(urljoin(str(target), location))
                    if (nxt.scheme, nxt.host, nxt.port) != (target.scheme, target.host, target.port):
                        raise MediaFetchRefused(
                            f"{_short(str(target))} redirects to another host or scheme "
                            f"({_short(str(nxt))}); redirects are followed only within one host"
                        )
                    target = nxt
                    continue
                if response.status_code != 200:
                    raise MediaFetchFailed(
                        f"fetching {_short(str(target))} returned HTTP {response.status_code}"
                    )
                return await self._read_limited(response, target)
        raise MediaFetchFailed(
            f"fetching an image URL took more than {self.policy.max_redirects} redirects"
        )

    async def _read_limited(self, response: httpx.Response, target: httpx.URL) -> bytes:
        limit = self.limits.max_image_bytes
        declared = response.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ImageTooLarge(f"{_short(str(target))} is {declared} bytes, above the limit "
                                f"of {limit} bytes (limits.max_image_bytes)")
        chunks: list[bytes] = []
        total = 0
        async for chunk in response.aiter_bytes():
            total += len(chunk)
            if total > limit:
                raise ImageTooLarge(f"{_short(str(target))} is more than {limit} bytes "
                                    "(limits.max_image_bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    def _get_client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                follow_redirects=False,
                trust_env=False,  # never route through an environment proxy
                timeout=httpx.Timeout(self.policy.fetch_timeout_s),
                limits=httpx.Limits(max_connections=32, max_keepalive_connections=8),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _short(url: str, keep: int = 120) -> str:
    """URLs in messages without query strings (they may carry tokens) and bounded in length."""
    parts = urlsplit(url)
    shown = f"{parts.scheme}://{parts.netloc}{parts.path}"
    return shown if len(shown) <= keep else shown[:keep] + "..."

"""The router's renderer: chat messages -> prompt token ids + prepared image items.

Built once from the checkpoint directory. `render` runs the CPU work off the event loop in
two bounded thread pools: one for the chat template and tokenizer, one for images (base64,
hashing, decode, resize, pixel_values, serialization), so a burst of large images cannot
delay a text-only request. It skips all image work for an image it has prepared before (LRU
by mm_hash) or is preparing right now for another request (single flight).

Image work lasts no longer than someone waits for it: when every request waiting for an
image has ended (timeout, client gone), its job is cancelled (a queued one never starts, a
running one stops at its next stage), and one client holds at most
`limits.image_jobs_per_client` image jobs at once (fairness.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .. import wire
from .cache import LruCache
from .cancel import WorkCancelled, stop_if
from .errors import ModelHasNoVision, PreprocessError, PromptMismatch, TooManyImages
from .fairness import ClientSlots, current_client
from .hashing import image_hash, settings_bytes
from .media import MediaFetcher, check_fetched_image, decode_data_url
from .messages import ImageRef, parse_messages
from .model_files import CheckpointFiles, VisionSettings
from .settings import Limits, Media
from .text import IncrementalDetokenizer, TextCodec

if TYPE_CHECKING:  # numpy and Pillow load with the first image (_image_tools), not at start
    from .decoding import ImageDecoder
    from .encoder import ItemEncoder
    from .image import PixelEncoder

T = TypeVar("T")

# A prompt with at most this many characters of message text is rendered and tokenized on
# the event loop (well under a millisecond), not in the text pool: the round trip to a pool
# thread costs more CPU than the work. Longer prompts still go to the pool.
INLINE_TEXT_CHARS = 8192

# A data: URL up to this size (base64 characters) is decoded and hashed on the event loop:
# ~30 µs for a 100 kB photo, less than a thread-pool round trip; larger ones go to the pool.
INLINE_DATA_URL_BYTES = 256 * 1024


@dataclass(frozen=True)
class PreparedImage:
    """The request-independent result of preparing one image (what the cache holds)."""

    mm_hash: str
    grid_thw: tuple[int, int, int]
    num_patches: int
    num_tokens: int  # placeholder length = patches / merge_size^2
    ve_kwargs: bytes  # base64 ASCII, spliced into VE bodies as is (never copied per request)
    pd_kwargs_b64: str
    source_size: tuple[int, int]  # (width, height) as sent
    resized_size: tuple[int, int]  # (width, height) fed to the patcher
    downscaled_for_budget: bool

    @property
    def ve_kwargs_b64(self) -> str:
        """`ve_kwargs` as text (a copy: for tools and tests, not the request path)."""
        return self.ve_kwargs.decode()


@dataclass(frozen=True)
class PreparedItem:
    """One image of a prompt, where it sits, and its wire payloads."""

    mm_hash: str
    offset: int  # index of the first <|image_pad|> in token_ids
    length: int  # number of <|image_pad|> tokens
    grid_thw: tuple[int, int, int]
    num_patches: int
    ve_kwargs: bytes  # full item for a VE (pixel_values + image_grid_thw), base64 ASCII
    pd_kwargs_b64: str  # LM-only item for a PD (image_grid_thw)
    downscaled_for_budget: bool = False

    @property
    def ve_kwargs_b64(self) -> str:
        """`ve_kwargs` as text (a copy: for tools and tests, not the request path)."""
        return self.ve_kwargs.decode()

    @property
    def placeholder(self) -> wire.Placeholder:
        return wire.Placeholder(offset=self.offset, length=self.length)


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    items: list[PreparedItem]  # prompt order, duplicates kept
    # characters of the chat template's text (an image one placeholder): vLLM's chat route
    # checks them before tokenizing (router/context_window.py)
    prompt_chars: int = 0

    def unique_items(self) -> dict[str, PreparedItem]:
        """First occurrence of each mm_hash, prompt order: what gets encoded."""
        out: dict[str, PreparedItem] = {}
        for item in self.items:
            out.setdefault(item.mm_hash, item)
        return out

    def pd_features(self) -> wire.Features:
        """`features` of the PD request (docs/contract.md §3.1): LM-only kwargs, duplicates kept."""
        return wire.Features.of_images(
            [i.mm_hash for i in self.items], [i.placeholder for i in self.items], [i.pd_kwargs_b64 for i in self.items]
        )


@dataclass(frozen=True)
class PreprocessStats:
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    cache_entries: int
    cache_bytes: int
    inflight_joins: int  # misses served by another request's in-progress preparation
    duplicates_in_request: int  # repeats of an image within one prompt (prepared once)
    images_prepared: int  # decode+resize+serialize actually run
    images_downscaled: int


class Preprocessor:
    def __init__(
        self,
        files: CheckpointFiles,
        *,
        model_id: str,
        limits: Limits,
        media: Media,
        workers: int | None = None,
        encoder: ItemEncoder | None = None,
    ) -> None:
        """`workers` overrides both pool sizes (`limits.text_workers`, `limits.image_workers`)."""
        if workers is not None and workers < 1:
            raise ValueError("workers must be >= 1")
        self.files = files
        self.model_id = model_id
        self.limits = limits
        self.media = media
        self.text = TextCodec(files)
        self.vision: VisionSettings | None = files.vision
        if self.vision is not None:
            _check_budget(self.vision, limits)
        # built by the first image (_image_tools); nothing in them can fail on what
        # `files.vision` accepted, so a bad checkpoint still fails here, at start
        self._pixels: PixelEncoder | None = None
        self._decoder: ImageDecoder | None = None
        self._tools_lock = threading.Lock()
        self._closed = False
        self._settings_blob = settings_bytes(
            {**(self.vision.pixel_settings() if self.vision else {}), "max_image_patches": limits.max_image_patches}
        )
        self._encoder: ItemEncoder | None = encoder
        self._fetcher = MediaFetcher(media, limits)
        self._text_pool = ThreadPoolExecutor(
            max_workers=workers or limits.text_workers, thread_name_prefix="epd-preprocess-text"
        )
        self._image_pool = ThreadPoolExecutor(
            max_workers=workers or limits.image_workers, thread_name_prefix="epd-preprocess-image"
        )
        self._cache: LruCache[PreparedImage] = LruCache(limits.image_cache_items, limits.image_cache_bytes)
        self._inflight: dict[str, _Inflight] = {}
        self._client_slots = ClientSlots(limits.image_jobs_per_client_effective)
        self._tasks: set[asyncio.Task[None]] = set()
        self._joins = self._duplicates = self._prepared = self._downscaled = 0

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        model_id: str | None = None,
        limits: Limits | None = None,
        media: Media | None = None,
        workers: int | None = None,
        encoder: ItemEncoder | None = None,
        engine_dtype: str = "auto",
    ) -> Preprocessor:
        """Local files only (never the hub). `model_id` feeds the content hash; it defaults to
        the path string as given, as vLLM uses its `--model` string. `engine_dtype` is the
        engines' `--dtype`: pixel values travel in the dtype it resolves to."""
        return cls(
            CheckpointFiles.load(path, engine_dtype=engine_dtype),
            model_id=model_id if model_id is not None else str(path),
            limits=limits or Limits(),
            media=media or Media(),
            workers=workers,
            encoder=encoder,
        )

    # --- text ---------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.text.eos_token_ids

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.text.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.text, skip_special_tokens=skip_special_tokens)

    # --- rendering ----------------------------------------------------------------------

    async def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        inline: Mapping[str, bytes | memoryview] | None = None,
    ) -> RenderedPrompt:
        """`inline`: base64 payloads of data: URLs kept apart from `messages` (the router's
        body decoding), by the URL as it stands in `messages`."""
        parsed = parse_messages(messages)
        self.text.check_message_text(parsed.template_messages)
        refs = parsed.images
        if refs and self.vision is None:
            raise ModelHasNoVision(
                f"model {self.model_id} ({self.files.architecture}) has no vision encoder; send text only",
                param=refs[0].param,
            )
        if len(refs) > self.limits.images_per_prompt:
            raise TooManyImages(
                f"{len(refs)} images in one request, above the limit of "
                f"{self.limits.images_per_prompt} (limits.images_per_prompt)",
                param="messages",
            )
        for ref in refs:  # refuse disallowed URLs before any work or network I/O
            if ref.url[:5].lower() != "data:":
                _with_param(ref, self._fetcher.check_allowed, ref.url)

        if _text_chars(parsed.template_messages) <= INLINE_TEXT_CHARS:
            text = self._tokenize(parsed.template_messages, add_generation_prompt)
            if not refs:  # text only: nothing to wait for (no tasks for a gather)
                return self._expand(text, [], refs)
            text_job = _done(text)
        else:
            text_job = self._run(self._text_pool, self._tokenize, parsed.template_messages, add_generation_prompt)
        images_job = self._prepare_all(refs, inline or {})
        results = await asyncio.gather(text_job, images_job, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        text, images = results  # type: ignore[misc]
        return self._expand(text, images, refs)

    @property
    def max_chars_per_token(self) -> int:
        return self.text.max_chars_per_token

    def _tokenize(self, template_messages: list[dict[str, Any]], add_generation_prompt: bool) -> tuple[list[int], int]:
        """The prompt's token ids and its text's characters."""
        text = self.text.render_template(template_messages, add_generation_prompt=add_generation_prompt)
        return self.text.encode(text), len(text)

    def _expand(self, text: tuple[list[int], int], images: list[PreparedImage], refs: list[ImageRef]) -> RenderedPrompt:
        token_ids, chars = text
        if self.vision is None:
            return RenderedPrompt(token_ids=token_ids, items=[], prompt_chars=chars)
        pad = self.vision.image_token_id
        found = token_ids.count(pad)
        if found != len(images):
            raise PromptMismatch(
                f"the rendered prompt has {found} image placeholder tokens for {len(images)} "
                "images; message text must not contain the model's image token "
                "(<|image_pad|>) itself",
                param="messages",
            )
        if not images:
            return RenderedPrompt(token_ids=token_ids, items=[], prompt_chars=chars)
        out: list[int] = []
        items: list[PreparedItem] = []
        it = iter(images)
        for tid in token_ids:
            if tid != pad:
                out.append(tid)
                continue
            image = next(it)
            items.append(
                PreparedItem(
                    mm_hash=image.mm_hash,
                    offset=len(out),
                    length=image.num_tokens,
                    grid_thw=image.grid_thw,
                    num_patches=image.num_patches,
                    ve_kwargs=image.ve_kwargs,
                    pd_kwargs_b64=image.pd_kwargs_b64,
                    downscaled_for_budget=image.downscaled_for_budget,
                )
            )
            out.extend([pad] * image.num_tokens)
        return RenderedPrompt(token_ids=out, items=items, prompt_chars=chars)

    # --- images -------------------------------------------------------------------------

    async def _prepare_all(self, refs: list[ImageRef], inline: Mapping[str, bytes | memoryview]) -> list[PreparedImage]:
        if not refs:
            return []
        loaded = await asyncio.gather(*(self._load(ref, inline.get(ref.url)) for ref in refs), return_exceptions=True)
        for result in loaded:  # first failing image in prompt order
            if isinstance(result, BaseException):
                raise result
        by_hash: dict[str, asyncio.Future[PreparedImage] | PreparedImage] = {}
        pending: list[_Inflight] = []
        for ref, (mm_hash, data) in zip(refs, loaded, strict=True):  # type: ignore[misc]
            if mm_hash in by_hash:
                self._duplicates += 1
                continue
            cached = self._cache.get(mm_hash)
            if cached is not None:
                by_hash[mm_hash] = cached
                continue
            job = self._inflight.get(mm_hash)
            if job is not None and not job.cancelled.is_set():
                self._joins += 1
            else:
                # registered before the first await, so a concurrent request joins it
                job = _Inflight(asyncio.get_running_loop().create_future())
                self._inflight[mm_hash] = job
                job.task = asyncio.create_task(self._prepare_into(job, mm_hash, data, ref))
                self._tasks.add(job.task)  # the loop keeps only weak references to tasks
                job.task.add_done_callback(self._tasks.discard)
            job.waiters += 1
            by_hash[mm_hash] = job.future
            pending.append(job)
        if pending:
            try:
                done = await asyncio.gather(*(asyncio.shield(j.future) for j in pending), return_exceptions=True)
            finally:
                for job in pending:
                    job.leave()
            for result in done:
                if isinstance(result, BaseException):
                    raise result
        out = []
        for _, (mm_hash, _) in zip(refs, loaded, strict=True):  # type: ignore[misc]
            entry = by_hash[mm_hash]
            out.append(entry if isinstance(entry, PreparedImage) else entry.result())
        return out

    async def _load(self, ref: ImageRef, payload: bytes | memoryview | None) -> tuple[str, bytes]:
        """Bytes and content hash of one image reference: a small data: URL right here (its
        base64 decode and hash cost less than the hop to the image pool), anything else in
        the pool."""
        if ref.url[:5].lower() == "data:":
            if len(payload if payload is not None else ref.url) <= INLINE_DATA_URL_BYTES:
                return _with_param(ref, self._read_data_url, ref.url, payload)
            return await self._run(self._image_pool, _with_param, ref, self._read_data_url, ref.url, payload)
        fetched = await _with_param_async(ref, self._fetcher.fetch(ref.url))
        return await self._run(self._image_pool, _with_param, ref, self._check_fetched, ref.url, fetched)

    def _read_data_url(self, url: str, payload: bytes | memoryview | None) -> tuple[str, bytes]:
        data = decode_data_url(url, self.limits, payload)
        return image_hash(self.model_id, data, self._settings_blob), data

    def _check_fetched(self, url: str, fetched: bytes) -> tuple[str, bytes]:
        data = check_fetched_image(url, fetched, self.limits)
        return image_hash(self.model_id, data, self._settings_blob), data

    async def _prepare_into(self, job: _Inflight, mm_hash: str, data: bytes, ref: ImageRef) -> None:
        """Runs as its own task: one request that leaves does not cancel work others share;
        the last one to leave does (`_Inflight.leave`)."""
        fut = job.future
        try:
            async with self._client_slots.hold(current_client.get()):
                work = asyncio.get_running_loop().run_in_executor(
                    self._image_pool, functools.partial(_with_param, ref, self._prepare, mm_hash, data, job.cancelled)
                )
                image = await _until_work_ends(work, job.cancelled)
        except BaseException as exc:
            fut.set_exception(exc if not isinstance(exc, asyncio.CancelledError) else WorkCancelled("cancelled"))
            fut.exception()  # marked retrieved: the requests awaiting it re-raise it
            return
        finally:
            if self._inflight.get(mm_hash) is job:
                del self._inflight[mm_hash]
        self._cache.put(mm_hash, image, len(image.ve_kwargs) + len(image.pd_kwargs_b64))
        fut.set_result(image)

    def _prepare(self, mm_hash: str, data: bytes, cancelled: threading.Event | None = None) -> PreparedImage:
        """Worker thread: decode, resize, pixel_values, serialize; stops between stages once
        `cancelled` is set (nobody waits for the image any more)."""
        assert self.vision is not None
        pixels, decoder, encoder = self._image_tools(self.vision)
        decoded = decoder.decode(data, cancelled)
        (width, height), plan = decoded.source_size, decoded.plan
        stop_if(cancelled)
        fill = functools.partial(pixels.pixel_values, decoded.resized)
        merge_area = self.vision.merge_size**2
        image = PreparedImage(
            mm_hash=mm_hash,
            grid_thw=plan.grid_thw,
            num_patches=plan.num_patches,
            num_tokens=plan.num_patches // merge_area,
            ve_kwargs=encoder.encode_ve(plan.grid_thw, pixels.shape(plan), pixels.dtype, fill),
            pd_kwargs_b64=encoder.encode_pd(plan.grid_thw),
            source_size=(width, height),
            resized_size=(plan.width, plan.height),
            downscaled_for_budget=plan.downscaled_for_budget,
        )
        self._prepared += 1  # int += under the GIL from worker threads: counts may lag, never corrupt
        self._downscaled += plan.downscaled_for_budget
        return image

    def _image_tools(self, vision: VisionSettings) -> tuple[PixelEncoder, ImageDecoder, ItemEncoder]:
        """The pixel encoder, the decoder and the item encoder, built by the first image's
        thread: they import numpy and Pillow (~0.2 CPU-s a start), which a router that is
        never sent an image does not need."""
        with self._tools_lock:
            if self._pixels is None or self._decoder is None or self._encoder is None:
                if self._closed:  # aclose has run: no decoder children after it
                    raise WorkCancelled("the preprocessor is closed")
                from .decoding import ImageDecoder
                from .encoder import MmSerdeEncoder
                from .image import PixelEncoder

                self._pixels, self._decoder = PixelEncoder(vision), ImageDecoder(self.limits, vision)
                self._encoder = self._encoder or MmSerdeEncoder()
            return self._pixels, self._decoder, self._encoder

    @staticmethod
    async def _run(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, functools.partial(fn, *args))

    # --- lifecycle and metrics ----------------------------------------------------------

    @property
    def stats(self) -> PreprocessStats:
        c = self._cache.stats
        return PreprocessStats(
            cache_hits=c.hits,
            cache_misses=c.misses,
            cache_evictions=c.evictions,
            cache_entries=len(self._cache),
            cache_bytes=c.bytes,
            inflight_joins=self._joins,
            duplicates_in_request=self._duplicates,
            images_prepared=self._prepared,
            images_downscaled=self._downscaled,
        )

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._fetcher.aclose()
        for pool in (self._text_pool, self._image_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        with self._tools_lock:
            self._closed = True
        if self._decoder is not None:
            self._decoder.close()


class _Inflight:
    """One image being prepared: its result, its task, and the requests waiting for it."""

    def __init__(self, future: asyncio.Future[PreparedImage]) -> None:
        self.future = future
        self.task: asyncio.Task[None] | None = None
        self.waiters = 0
        self.cancelled = threading.Event()  # read by the worker thread between stages

    def leave(self) -> None:
        """A waiting request is done with it (answered or ended); the last one out stops
        work nobody will read."""
        self.waiters -= 1
        if self.waiters == 0 and not self.future.done():
            self.cancelled.set()
            if self.task is not None:
                self.task.cancel()


async def _until_work_ends(work: asyncio.Future[T], cancelled: threading.Event) -> T:
    """`work`'s result. Cancelled (every request waiting for the image has ended), it stops
    the work (`cancelled`: the thread stops at its next stage, a decode in a child process
    at once) and still waits for the thread to be done before it re-raises: the caller's
    client slot is held until the work has actually ended, not just until nobody waits."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        cancelled.set()
        with contextlib.suppress(BaseException):
            await asyncio.wait({work})  # a second cancel (shutdown) ends this wait
        raise


def _check_budget(vision: VisionSettings, limits: Limits) -> None:
    min_patches = vision.merge_size**2
    if limits.max_image_patches < min_patches:
        raise ValueError(
            f"limits.max_image_patches must be at least {min_patches} "
            f"(one merged token of {vision.factor}x{vision.factor} pixels)"
        )


def _text_chars(template_messages: list[dict[str, Any]]) -> int:
    """Characters of message text (string contents and text parts)."""
    total = 0
    for message in template_messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return total


async def _done(value: T) -> T:
    """An already computed value as an awaitable (to gather with work still running)."""
    return value


def _with_param(ref: ImageRef, fn: Callable[..., T], *args: Any) -> T:
    """Run fn; label a PreprocessError with the request position of the image."""
    try:
        return fn(*args)
    except PreprocessError as exc:
        if exc.param is None:
            exc.param = ref.param
        raise


async def _with_param_async(ref: ImageRef, coro: Any) -> Any:
    try:
        return await coro
    except PreprocessError as exc:
        if exc.param is None:
            exc.param = ref.param
        raise

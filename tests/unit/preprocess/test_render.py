"""Rendering: prompt ids, placeholders, items, hashing, caching, and every bad-input error."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from blake3 import blake3

from epd_kit import mm_serde, wire
from epd_kit.preprocess import (
    ImageOverBudget,
    ImageTooLarge,
    InvalidMessages,
    Limits,
    MalformedImageUrl,
    MediaFetchRefused,
    ModelHasNoVision,
    NotAnImage,
    PreprocessError,
    PromptMismatch,
    TooManyImages,
    UnsupportedContent,
    VideoNotSupported,
)
from epd_kit.preprocess.image import ImageDimensionsRejected
from epd_kit.preprocess.preprocessor import INLINE_TEXT_CHARS
from epd_kit.testing.images import data_url, encode_image, image_part, make_image, png_data_url, user_message

IMG_512x341 = png_data_url(512, 341, seed=1)


def _pad_runs(ids: list[int], pad: int) -> list[tuple[int, int]]:
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == pad:
            j = i
            while j < len(ids) and ids[j] == pad:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


async def test_one_image_contract_example(pre) -> None:
    rendered = await pre.render([user_message("Describe", image_part(IMG_512x341), "briefly.")])
    (item,) = rendered.items
    assert item.grid_thw == (1, 22, 32) and item.num_patches == 704 and item.length == 176
    pad = pre.vision.image_token_id
    assert _pad_runs(rendered.token_ids, pad) == [(item.offset, 176)]
    # the markers sit just outside the placeholder range
    assert rendered.token_ids[item.offset - 1] == pre.vision.vision_start_token_id
    assert rendered.token_ids[item.offset + 176] == pre.vision.vision_end_token_id
    ve = mm_serde.decode_item_b64(item.ve_kwargs_b64)
    assert ve["pixel_values"].data.shape == (704, 1536)
    assert ve["pixel_values"].spec.factory == "flat"
    assert mm_serde.grid_thw(ve) == (1, 22, 32)
    pd = mm_serde.decode_item_b64(item.pd_kwargs_b64)
    assert set(pd) == {"image_grid_thw"} and mm_serde.grid_thw(pd) == (1, 22, 32)


async def test_prompt_equals_transformers_chat_template_with_expanded_pads(pre, checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    messages = [
        {"role": "system", "content": "You are terse. ünïcödé 你好"},
        user_message("one", image_part(IMG_512x341), "two", image_part(png_data_url(64, 64))),
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and now?"},
    ]
    rendered = await pre.render(messages)
    hf_messages = [
        {**m, "content": [{"type": "image"} if p.get("type") == "image_url" else p for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    expected = tok.apply_chat_template(hf_messages, tokenize=True, add_generation_prompt=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    pad = pre.vision.image_token_id
    expanded: list[int] = []
    lengths = iter(i.length for i in rendered.items)
    for tid in expected:
        expanded.extend([pad] * next(lengths) if tid == pad else [tid])
    assert rendered.token_ids == expanded
    no_gen = await pre.render(messages, add_generation_prompt=False)
    assert len(no_gen.token_ids) < len(rendered.token_ids)


async def test_text_only_request_has_no_items(pre) -> None:
    rendered = await pre.render([{"role": "user", "content": "hello"}])
    assert rendered.items == [] and rendered.token_ids
    assert rendered.pd_features() == wire.Features()


async def test_multi_image_with_duplicates(pre) -> None:
    a, b = png_data_url(512, 341, seed=11), png_data_url(300, 200, seed=12)
    rendered = await pre.render([user_message(image_part(a), "x", image_part(b), "y", image_part(a))])
    hashes = [i.mm_hash for i in rendered.items]
    assert hashes[0] == hashes[2] != hashes[1]
    assert list(rendered.unique_items()) == [hashes[0], hashes[1]]
    offsets = [i.offset for i in rendered.items]
    assert offsets == sorted(offsets)
    assert _pad_runs(rendered.token_ids, pre.vision.image_token_id) == [(i.offset, i.length) for i in rendered.items]
    stats = pre.stats
    assert (stats.images_prepared, stats.duplicates_in_request, stats.cache_misses) == (2, 1, 2)
    features = rendered.pd_features()
    assert features.mm_hashes == {"image": hashes}
    assert [p.offset for p in features.mm_placeholders["image"]] == offsets


async def test_cache_hit_skips_decode_resize_and_serialization(pre, monkeypatch) -> None:
    msg = [user_message(image_part(png_data_url(256, 256, seed=21)))]
    first = await pre.render(msg)
    assert (pre.stats.cache_hits, pre.stats.cache_misses, pre.stats.images_prepared) == (0, 1, 1)

    def must_not_run(*_a, **_k):
        raise AssertionError("a cached image was prepared again")

    monkeypatch.setattr(pre, "_prepare", must_not_run)
    second = await pre.render(msg)
    assert (pre.stats.cache_hits, pre.stats.cache_misses, pre.stats.images_prepared) == (1, 1, 1)
    assert second.items[0].ve_kwargs is first.items[0].ve_kwargs  # the cached bytes themselves


async def test_concurrent_requests_prepare_a_new_image_once(pre) -> None:
    msg = [user_message(image_part(png_data_url(640, 480, seed=31)))]
    results = await asyncio.gather(*(pre.render(msg) for _ in range(5)))
    assert len({r.items[0].mm_hash for r in results}) == 1
    assert pre.stats.images_prepared == 1
    assert pre.stats.inflight_joins + pre.stats.cache_hits == 4


async def test_cache_is_bounded_in_entries_and_bytes(make_preprocessor) -> None:
    small = make_preprocessor(limits=Limits(image_cache_items=2))
    for seed in range(3):
        await small.render([user_message(image_part(png_data_url(64, 64, seed=seed)))])
    assert small.stats.cache_entries == 2 and small.stats.cache_evictions == 1
    tight = make_preprocessor(limits=Limits(image_cache_bytes=1_000_000))  # one 256x256 item is ~1.1 MB of base64
    await tight.render([user_message(image_part(png_data_url(256, 256, seed=5)))])
    assert tight.stats.cache_entries == 0


async def test_hash_follows_the_documented_scheme(pre, checkpoint: Path) -> None:
    raw = encode_image(make_image(100, 80, seed=3))
    rendered = await pre.render([user_message(image_part(data_url(raw)))])
    settings = {
        **pre.vision.pixel_settings(),
        "max_image_patches": pre.limits.max_image_patches,
        "scheme": "epd-kit/mm-hash/1",
    }
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    expected = blake3(b"model_id" + str(checkpoint).encode() + b"image" + raw + b"processor" + blob).hexdigest()
    assert rendered.items[0].mm_hash == expected
    assert len(expected) == 64 and expected == expected.lower()


async def test_hash_depends_on_model_id_bytes_and_budget(make_preprocessor) -> None:
    raw = encode_image(make_image(100, 80, seed=3))
    msg = [user_message(image_part(data_url(raw)))]
    base = (await make_preprocessor(model_id="m").render(msg)).items[0].mm_hash
    other_model = (await make_preprocessor(model_id="n").render(msg)).items[0].mm_hash
    other_budget = (
        (await make_preprocessor(model_id="m", limits=Limits(max_image_patches=2048)).render(msg)).items[0].mm_hash
    )
    reencoded = encode_image(make_image(100, 80, seed=3), "PNG", compress_level=1)
    assert reencoded != raw
    other_bytes = (
        (await make_preprocessor(model_id="m").render([user_message(image_part(data_url(reencoded)))])).items[0].mm_hash
    )
    assert len({base, other_model, other_budget, other_bytes}) == 4


async def test_oversized_image_is_downscaled_to_the_budget(make_preprocessor) -> None:
    pre = make_preprocessor(limits=Limits(max_image_patches=1024))
    rendered = await pre.render([user_message(image_part(png_data_url(1024, 768)))])
    item = rendered.items[0]
    assert item.downscaled_for_budget and item.num_patches <= 1024
    assert item.length == item.num_patches // 4
    assert pre.stats.images_downscaled == 1


async def test_oversized_image_is_rejected_when_configured(make_preprocessor) -> None:
    pre = make_preprocessor(limits=Limits(max_image_patches=1024, oversized_image="reject"))
    with pytest.raises(ImageOverBudget) as err:
        await pre.render([user_message("hi", image_part(png_data_url(1024, 768)))])
    assert err.value.status == 400 and err.value.param == "messages[0].content[1]"
    assert "limits.max_image_patches" in err.value.message


async def test_text_only_checkpoint_renders_text_and_refuses_images(
    make_preprocessor, text_only_checkpoint: Path
) -> None:
    pre = make_preprocessor(text_only_checkpoint)
    assert (await pre.render([{"role": "user", "content": "hi"}])).items == []
    with pytest.raises(ModelHasNoVision, match="Qwen3ForCausalLM"):
        await pre.render([user_message(image_part(IMG_512x341))])


def test_budget_below_one_token_is_a_config_error(make_preprocessor) -> None:
    with pytest.raises(ValueError, match="at least 4"):
        make_preprocessor(limits=Limits(max_image_patches=3))


@pytest.mark.parametrize(
    ("messages", "error", "status", "text"),
    [
        ([], InvalidMessages, 400, "non-empty list"),
        ("hello", InvalidMessages, 400, "non-empty list"),
        ([{"content": "no role"}], InvalidMessages, 400, "role"),
        ([{"role": "wizard", "content": "x"}], InvalidMessages, 400, "not one of"),
        ([{"role": "user", "content": 5}], InvalidMessages, 400, "content"),
        ([{"role": "user"}], InvalidMessages, 400, "needs content"),
        ([{"role": "user", "content": [{"type": "text"}]}], InvalidMessages, 400, "string 'text'"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], InvalidMessages, 400, "image_url"),
        ([user_message({"type": "input_audio", "input_audio": {}})], UnsupportedContent, 400, "input_audio"),
        ([user_message({"type": "hologram"})], UnsupportedContent, 400, "unknown content part"),
        ([user_message({"type": "video_url", "video_url": {"url": "x"}})], VideoNotSupported, 400, "video"),
        ([user_message(image_part("data:image/png;base64"))], MalformedImageUrl, 400, "no ','"),
        ([user_message(image_part("data:image/png;base64,@@@"))], MalformedImageUrl, 400, "not valid base64"),
        ([user_message(image_part("data:image/png,abc"))], MalformedImageUrl, 400, "base64 encoded"),
        ([user_message(image_part("data:text/plain;base64,aGk="))], MalformedImageUrl, 400, "not an image type"),
        (
            [user_message(image_part("data:image/png;base64,aGVsbG8gd29ybGQ="))],
            NotAnImage,
            400,
            "not a decodable image",
        ),
        ([user_message(image_part("ftp://example.com/x.png"))], MalformedImageUrl, 400, "scheme 'ftp'"),
        ([user_message(image_part("file:///etc/passwd"))], MalformedImageUrl, 400, "scheme 'file'"),
        ([user_message(image_part("http://127.0.0.1:9/x.png"))], MediaFetchRefused, 400, "media.allow_http"),
        ([user_message("<|image_pad|>", image_part(IMG_512x341))], PromptMismatch, 400, "placeholder tokens"),
    ],
)
async def test_bad_input_errors(pre, messages, error, status: int, text: str) -> None:
    with pytest.raises(error) as err:
        await pre.render(messages)
    assert isinstance(err.value, PreprocessError)
    assert err.value.status == status and text in err.value.message


async def test_too_many_images(make_preprocessor) -> None:
    pre = make_preprocessor(limits=Limits(images_per_prompt=2))
    url = png_data_url(32, 32)
    await pre.render([user_message(image_part(url), image_part(url))])
    with pytest.raises(TooManyImages, match=r"3 images .* limit of 2 \(limits.images_per_prompt\)"):
        await pre.render([user_message(image_part(url), image_part(url), image_part(url))])


async def test_image_too_large_in_bytes_is_413(make_preprocessor) -> None:
    raw = encode_image(make_image(300, 300, seed=9))
    pre = make_preprocessor(limits=Limits(max_image_bytes=len(raw) - 1))
    with pytest.raises(ImageTooLarge) as err:
        await pre.render([user_message(image_part(data_url(raw)))])
    assert err.value.status == 413 and "limits.max_image_bytes" in err.value.message
    ok = make_preprocessor(limits=Limits(max_image_bytes=len(raw)))
    assert len((await ok.render([user_message(image_part(data_url(raw)))])).items) == 1


async def test_decompression_bomb_guard(make_preprocessor) -> None:
    pre = make_preprocessor(limits=Limits(max_image_pixels=100 * 100))
    with pytest.raises(ImageDimensionsRejected, match="decode limit"):
        await pre.render([user_message(image_part(png_data_url(101, 100)))])


async def test_errors_name_the_failing_image(pre) -> None:
    good = png_data_url(32, 32)
    with pytest.raises(NotAnImage) as err:
        await pre.render(
            [
                {"role": "user", "content": "a"},
                user_message(image_part(good), "b", image_part("data:image/png;base64,AAAA")),
            ]
        )
    assert err.value.param == "messages[1].content[2]"


async def test_data_url_with_whitespace_and_jpeg(pre) -> None:
    raw = encode_image(make_image(200, 150), "JPEG", quality=80)
    url = data_url(raw, "image/jpeg")
    wrapped = url[:60] + "\n" + url[60:]
    rendered = await pre.render([user_message(image_part(wrapped))])
    assert rendered.items[0].grid_thw == (1, 14, 20)  # 200x150 grows past min_pixels to 320x224


async def test_ve_pixels_equal_the_numpy_pipeline(pre) -> None:
    from epd_kit.preprocess.image import PixelEncoder, decode_image, plan_resize

    raw = encode_image(make_image(333, 222, seed=4))
    rendered = await pre.render([user_message(image_part(data_url(raw)))])
    img = decode_image(raw, pre.limits)
    enc = PixelEncoder(pre.vision)
    expected = enc.pixel_values(enc.resize(img, plan_resize(img.height, img.width, pre.vision, pre.limits)))
    got = mm_serde.decode_item_b64(rendered.items[0].ve_kwargs_b64)["pixel_values"].data
    np.testing.assert_array_equal(got, expected)


async def test_data_url_variants_accepted(pre) -> None:
    raw = encode_image(make_image(64, 64, seed=8))
    import base64

    b64 = base64.b64encode(raw).decode()
    variants = [f"data:;base64,{b64}", f"DATA:IMAGE/PNG;BASE64,{b64}", f"data:image/png;charset=binary;base64,{b64}"]
    parts = [image_part(v) for v in variants] + [{"type": "image_url", "image_url": variants[0]}]
    rendered = await pre.render([user_message(*parts)])
    assert len({i.mm_hash for i in rendered.items}) == 1 and len(rendered.items) == 4


async def test_cpu_work_runs_in_the_worker_pool_not_on_the_event_loop(pre, monkeypatch) -> None:
    import threading

    seen: list[str] = []
    real_prepare, real_tokenize = pre._prepare, pre._tokenize

    def prepare(*args):
        seen.append(threading.current_thread().name)
        return real_prepare(*args)

    def tokenize(*args):
        seen.append(threading.current_thread().name)
        return real_tokenize(*args)

    monkeypatch.setattr(pre, "_prepare", prepare)
    monkeypatch.setattr(pre, "_tokenize", tokenize)
    await pre.render([user_message(image_part(png_data_url(128, 128, seed=77)))])
    # a short prompt is tokenized right on the loop (cheaper than the hop); pixels never are
    assert seen == [threading.current_thread().name, "epd-preprocess-image_0"]
    seen.clear()
    long_text = "word " * (INLINE_TEXT_CHARS // 5 + 1)
    await pre.render([{"role": "user", "content": long_text}])
    assert len(seen) == 1 and seen[0].startswith("epd-preprocess-text")


async def test_every_special_token_of_the_tokenizer_is_refused_in_message_text(pre) -> None:
    """Issue 58: `<|image_pad|>` was refused, `<|video_pad|>`, `<|vision_start|>` and
    `<|vision_end|>` reached the PD. The set is the tokenizer's own (tokenizer.json's special
    added tokens), wherever the template could write the text: content, a text part, a name."""
    from epd_kit.preprocess.errors import SpecialTokenInText

    tokens = pre.text.special_tokens
    assert {"<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|im_end|>"} <= tokens
    for token in sorted(tokens):
        for message, where in (
            ({"role": "user", "content": f"a {token} b"}, "messages[0].content"),
            (user_message("fine", f"x{token}"), "messages[0].content[1].text"),
            ({"role": "user", "content": "fine", "name": token}, "messages[0].name"),
        ):
            with pytest.raises(SpecialTokenInText) as err:
                await pre.render([message])
            assert err.value.status == 400 and err.value.param == where
            assert token in err.value.message
    # text that only looks like one, and an image beside plain text, render
    await pre.render([{"role": "user", "content": "<|video pad|> <vision_start> |im_end|"}])
    await pre.render([user_message("describe", image_part(png_data_url(32, 32)))])


# A template that uses what render_template puts in its context: the environment's globals
# (namespace, raise_exception), the special tokens, tools/documents, and the messages
_PROBE_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if m.role == 'tool' %}{{ raise_exception('no tools here: ' ~ m.role) }}{% endif %}"
    "{{ eos_token }}|{{ m.role }}:{{ m.content | tojson }}|{{ tools is none }}{{ documents is none }}"
    "{% endfor %}{{ ns.n }}{% if add_generation_prompt %}>>{% endif %}"
)


def test_the_template_renders_as_jinja2_renders_it_and_its_refusal_is_a_400(checkpoint):
    """TextCodec renders through Template.new_context with the fixed variables flattened once
    (not Template.render, which copies the globals per call): the same text as jinja2's own
    render with the same variables, and raise_exception() is still InvalidMessages."""
    import dataclasses

    from epd_kit.preprocess.model_files import CheckpointFiles
    from epd_kit.preprocess.text import TextCodec

    files = dataclasses.replace(CheckpointFiles.load(checkpoint), chat_template=_PROBE_TEMPLATE)
    codec = TextCodec(files)
    messages = [{"role": "system", "content": 'é "q"'}, {"role": "user", "content": "hi"}]
    for add in (True, False):
        expected = codec._template.render(
            messages=messages, add_generation_prompt=add, tools=None, documents=None, **files.special_tokens
        )
        assert codec.render_template(messages, add_generation_prompt=add) == expected
        assert expected.startswith(f'{files.special_tokens["eos_token"]}|system:"é \\"q\\""|TrueTrue')
    with pytest.raises(InvalidMessages, match="no tools here: tool") as raised:
        codec.render_template([{"role": "tool", "content": "x"}], add_generation_prompt=True)
    assert raised.value.param == "messages"

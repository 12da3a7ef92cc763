"""Detokenization: full and incremental, multi-byte characters split across tokens."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from epd_kit.preprocess import Preprocessor

CLEF = "\U0001d11e"  # 4 UTF-8 bytes, not in the tiny tokenizer's corpus: one byte per token


def test_a_four_byte_character_is_held_back_until_complete(pre: Preprocessor) -> None:
    ids = pre.text.encode(CLEF)
    assert len(ids) == 4  # one byte-level token per UTF-8 byte
    detok = pre.detokenizer()
    assert [detok.push([i]) for i in ids] == ["", "", "", CLEF]
    assert detok.text == CLEF


def test_text_around_split_characters(pre: Preprocessor) -> None:
    text = f"ab{CLEF}c 你好{CLEF}{CLEF}!"
    ids = pre.text.encode(text)
    detok = pre.detokenizer()
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(pre: Preprocessor) -> None:
    im_end = pre.text.token_id("<|im_end|>")
    ids = pre.text.encode("Hello") + [im_end]
    assert pre.detokenize(ids) == "Hello"
    assert pre.detokenize(ids, skip_special_tokens=False) == "Hello<|im_end|>"
    kept = pre.detokenizer(skip_special_tokens=False)
    assert "".join(kept.push([i]) for i in ids) == "Hello<|im_end|>"
    skipped = pre.detokenizer()
    assert "".join(skipped.push([i]) for i in ids) == "Hello"


def test_an_incomplete_tail_is_left_out_as_vllm_leaves_it(pre: Preprocessor) -> None:
    """vLLM's text is its DecodeStream steps (v1/engine/detokenizer.py): an open sequence at
    the end never becomes U+FFFD there, though a whole decode shows it; pushed whole or per
    token, the same."""
    ids = pre.text.encode("ok" + CLEF)[:-1]  # last byte never arrives
    detok = pre.detokenizer()
    assert "".join(detok.push([i]) for i in ids) == "ok"
    assert detok.text == "ok" and pre.detokenize(ids).startswith("ok\ufffd")
    assert pre.detokenizer().push(ids) == "ok"


def test_pushed_whole_or_per_token_the_text_is_the_same(pre: Preprocessor) -> None:
    """One DecodeStream step per token: a chunk whose last token opens a sequence still
    gives the text before it (pushed whole, the window used to hold it all back)."""
    ids = pre.text.encode("ab" + CLEF + "c" + CLEF)[:-2]
    per_token = pre.detokenizer()
    assert pre.detokenizer().push(ids) == "".join(per_token.push([i]) for i in ids) == "ab" + CLEF + "c"


def test_eos_ids(pre: Preprocessor) -> None:
    assert pre.eos_token_ids == {pre.text.token_id("<|im_end|>"), pre.text.token_id("<|endoftext|>")}


def test_full_decode_matches_transformers(pre: Preprocessor, checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    ids = pre.text.encode(f"<|im_start|>assistant\nHé {CLEF} 你好<|im_end|>")
    for skip in (True, False):
        assert pre.detokenize(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=40).filter(lambda t: "\ufffd" not in t), data=st.data())
def test_streamed_deltas_equal_the_full_text(checkpoint: Path, text: str, data: st.DataObject) -> None:
    pre = _shared(checkpoint)
    ids = pre.text.encode(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=False)]
    detok = pre.detokenizer(skip_special_tokens=False)
    deltas = [detok.push(c) for c in chunks]
    assert "".join(deltas) == pre.detokenize(ids, skip_special_tokens=False) == text
    assert not any("\ufffd" in d for d in deltas)


_PRE: dict[Path, Preprocessor] = {}


def _shared(path: Path) -> Preprocessor:
    # text-only use: no event loop, no images; one instance for all hypothesis examples
    if path not in _PRE:
        _PRE[path] = Preprocessor.from_checkpoint(path, workers=1)
    return _PRE[path]


def _stepped(pre: Preprocessor, ids: list[int], skip: bool) -> str:
    """The per-token steps alone (DecodeStream's windows), without push's byte-level shortcut."""
    detok = pre.detokenizer(skip_special_tokens=skip)
    return "".join(detok._step(t) for t in ids)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_byte_level_shortcut_gives_the_steps_text_for_any_ids(checkpoint: Path, data: st.DataObject) -> None:
    """Issue 58 item 6: push decodes a chunk once when the decoder is byte-level and the window
    ends at a character boundary. Any ids (bytes that never form a character, split and
    interleaved characters, special tokens), cut into any chunks, skip or keep: the same deltas'
    text as one step per token, and the text stepped on from there the same too."""
    pre = _shared(checkpoint)
    assert pre.text.byte_level  # the tiny checkpoint's decoder, as Qwen's: ByteLevel
    limit = pre.text.vocab_size
    ids = data.draw(st.lists(st.integers(0, limit - 1), max_size=24))
    skip = data.draw(st.booleans())
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=False)]
    detok = pre.detokenizer(skip_special_tokens=skip)
    assert "".join(detok.push(c) for c in chunks) == _stepped(pre, ids, skip)
    assert detok.token_ids == ids


def test_the_shortcut_holds_back_an_open_character_and_steps_on(pre: Preprocessor) -> None:
    ids = pre.text.encode("ab" + CLEF + "c")
    detok = pre.detokenizer()
    assert detok.push(ids[:3]) == "ab"  # 'a', 'b', the clef's first byte: U+FFFD, so the steps
    assert detok.push(ids[3:]) == CLEF + "c"
    assert detok.push(pre.text.encode(" ok")) == " ok"  # the shortcut again from the boundary
    assert detok.text == "ab" + CLEF + "c ok"

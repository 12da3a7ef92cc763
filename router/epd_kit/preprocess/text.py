"""Tokenizer, chat template and detokenization, from the checkpoint's own files.

Uses the `tokenizers` library on tokenizer.json and jinja2 for the template, configured like
transformers' `apply_chat_template` (sandboxed, trim_blocks, lstrip_blocks, loopcontrols,
non-escaping `tojson`, `raise_exception`, `strftime_now`), so the result equals
`AutoTokenizer.apply_chat_template(..., tokenize=True)` without importing transformers on the
request path.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

from .errors import InvalidMessages, SpecialTokenInText
from .model_files import CheckpointError, CheckpointFiles


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class TokenIdOutOfRange(ValueError):
    """Token ids to detokenize that are no ids of the model (an engine's answer can be
    anything): `tokenizers` raises OverflowError on some (-1, 2**40) and skips others."""


class TextCodec:
    """Thread-safe after construction: `tokenizers.Tokenizer` encode/decode and a compiled
    jinja2 template hold no per-call state."""

    def __init__(self, files: CheckpointFiles) -> None:
        # every encode here is a batch of one text, which rayon's pool cannot split: with
        # parallelism on, `tokenizers` still hands it to the pool's threads (huggingface/tokenizers
        # utils/parallelism.rs: into_maybe_par_iter, TOKENIZERS_PARALLELISM read per call), a
        # thread hop that cost ~7 µs of CPU per prompt here (docs/benchmarks.md "Issue 58 item 6").
        # An operator's own setting is kept
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            self.tokenizer = Tokenizer.from_file(str(files.tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise CheckpointError(f"{files.tokenizer_file} is not a tokenizers file: {exc}") from exc
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(files.chat_template)
        except jinja2.TemplateError as exc:
            raise CheckpointError(f"the chat template of {files.path} does not compile: {exc}") from exc
        self._encode_batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        # a byte-level decoder (GPT-2's, Qwen's) decodes the tokens' bytes, concatenated, with one
        # lossy UTF-8 decode (huggingface/tokenizers src/pre_tokenizers/byte_level.rs, `impl Decoder
        # for ByteLevel`: String::from_utf8_lossy), so a decode of a chunk that starts at a
        # character boundary is its own characters: IncrementalDetokenizer's shortcut
        self.byte_level = isinstance(self.tokenizer.decoder, decoders.ByteLevel)
        self._special = dict(files.special_tokens)
        # the variables every render has, the template's globals first (they come first in the
        # dict jinja2's Template.render builds per call: runtime.new_context, jinja2 3.1), flattened
        # once: render copies the globals, a ChainMap read key by key in Python, on every call
        self._fixed_vars = {**self._template.globals, "tools": None, "documents": None, **self._special}
        eos = set(files.eos_token_ids_config)
        for text in files.eos_token_strings:
            if (tid := self.tokenizer.token_to_id(text)) is not None:
                eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # ids the model can emit: its output rows, at least the tokenizer's vocabulary
        self.id_limit = max(self.vocab_size, files.model_vocab_size)
        # the tokens only the chat template may write: every added token tokenizer.json marks
        # special (the media placeholders <|image_pad|> <|video_pad|> <|vision_start|>
        # <|vision_end|>, the turn markers, end of text). `tokenizers` reads them out of any text
        # (as vLLM's HF tokenizer does), so one in a message would be that token: a forged
        # placeholder or turn. The tokenizer's own list, longest first (one match at a place).
        specials = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
        self.special_tokens: frozenset[str] = frozenset(specials)
        alternatives = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
        self._special_re = re.compile(alternatives) if specials else None
        # the longest token's text, as vLLM's tokenizer wrapper counts it (max over get_vocab(),
        # added tokens included: vllm/tokenizers/hf.py, 0.24.0 and 0.29.0), for its chat route's
        # prompt-characters check (router/context_window.py)
        self.max_chars_per_token = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)))

    def render_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        template = self._template
        # what Template.render does, with the context's variables built from `_fixed_vars`
        # (shared=True: taken as they are, the globals already in them)
        context = template.new_context(
            {**self._fixed_vars, "messages": messages, "add_generation_prompt": add_generation_prompt}, shared=True
        )
        try:
            try:
                return template.environment.concat(template.root_render_func(context))  # type: ignore[attr-defined]
            except Exception:
                template.environment.handle_exception()  # raises it again, with the template's lines
        except jinja2.TemplateError as exc:
            # templates use raise_exception() to reject message sequences (roles, order)
            raise InvalidMessages(f"the model's chat template rejected the messages: {exc}", param="messages") from exc

    def special_token_in(self, text: str) -> str | None:
        """The first special token `text` holds, or None."""
        found = self._special_re.search(text) if self._special_re is not None else None
        return found.group() if found else None

    def check_message_text(self, template_messages: list[dict[str, Any]]) -> None:
        """Raise SpecialTokenInText for a message whose text (its content, a text part, or any
        other string the template may write: a name, a tool call) holds a special token."""
        if self._special_re is None:
            return
        search = self._special_re.search
        for i, message in enumerate(template_messages):
            content = message.get("content")
            if len(message) == 2 and type(content) is str and search(content) is None:
                continue  # the common text message, clean: one search
            for where, text in _strings(message, f"messages[{i}]"):
                token = self.special_token_in(text)
                if token is not None:
                    raise SpecialTokenInText(
                        f"the text contains {token}, one of the model's special tokens (the placeholder "
                        "tokens and markers only its chat template writes); remove it from the message",
                        param=where,
                    )

    def encode(self, text: str) -> list[int]:
        # encode_batch(_fast), not encode: it releases the GIL while it works (a megabyte of
        # text is seconds of CPU that must not stop the event loop); the ids are the same.
        # The _fast variant (tokenizers >= 0.20) skips the offsets nobody reads: a quarter
        # less CPU per prompt
        return self._encode_batch([text], add_special_tokens=False)[0].ids

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(token_ids)
        self.check_ids(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def check_ids(self, token_ids: Sequence[int]) -> None:
        """Raise TokenIdOutOfRange unless every id is an int in [0, id_limit) (not a float,
        bool or string either: a stream's ids come straight from its JSON)."""
        limit = self.id_limit
        for t in token_ids:
            if type(t) is not int or not 0 <= t < limit:
                raise TokenIdOutOfRange(f"token id {t!r:.40} is outside the model's vocabulary [0, {limit})")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def _strings(value: Any, where: str) -> list[tuple[str, str]]:
    """Every string in a template message, with where it is; an image part's URL excepted (the
    template never writes it, and it may be megabytes)."""
    if isinstance(value, str):
        return [(where, value)]
    if isinstance(value, dict):
        if value.get("type") == "image_url":
            return []
        return [s for key, item in value.items() if key != "role" for s in _strings(item, f"{where}.{key}")]
    if isinstance(value, list):
        return [s for j, item in enumerate(value) for s in _strings(item, f"{where}[{j}]")]
    return []


class IncrementalDetokenizer:
    """Text deltas for one choice's growing token list, as vLLM's chat route makes its text.

    Each token is one step of tokenizers' `DecodeStream`, what vLLM's detokenizer uses for a
    fast tokenizer (vllm 0.24.0 and 0.32.0 v1/engine/detokenizer.py
    `FastIncrementalDetokenizer.decode_next`: `stream.step(tokenizer, id)`, None as ""): decode a
    short window before and after the token and emit the difference; while the window ends in
    U+FFFD (an incomplete UTF-8 sequence, e.g. half an emoji) the text is held back until the rest
    arrives. A tail that never completes is never emitted: vLLM has no step after the last token
    (`get_next_output_text` returns the text stepped so far), so its text ends before the open
    sequence where a whole decode ends in U+FFFD. Concatenated deltas equal `decode(all ids)` for
    every token sequence that decodes to valid UTF-8.

    The steps' shortcut, same text: with a byte-level decoder (`TextCodec.byte_level`: decode =
    the tokens' bytes concatenated, then one lossy UTF-8 decode) and every token read so far
    emitted (the window ends at a character boundary), a chunk whose own decode holds no U+FFFD
    is valid UTF-8 on its own: each step would emit exactly its new characters, so their
    concatenation is that one decode, and the state after it (window at the chunk's end) steps
    the next token as the per-token windows would. One decode per chunk instead of two per token
    (a 16-token completion: 1 call instead of 32; docs/benchmarks.md "Issue 58 item 6"). Any
    U+FFFD in it, another decoder, or text held back: the steps, as before.
    """

    def __init__(self, codec: TextCodec, *, skip_special_tokens: bool = True) -> None:
        self._codec = codec
        self._skip = skip_special_tokens
        self._raw_decode = codec.tokenizer.decode  # ids checked once in push, not per window
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._raw_decode(ids, skip_special_tokens=self._skip)

    def push(self, new_ids: Sequence[int]) -> str:
        self._codec.check_ids(new_ids)  # before they join the window: a bad id must not stay
        if self._codec.byte_level and self._read == len(self.token_ids) and new_ids:
            chunk = self._decode(list(new_ids))
            if "\ufffd" not in chunk:
                self.token_ids.extend(new_ids)
                self._prefix = self._read = len(self.token_ids)
                self.text += chunk
                return chunk
        return "".join(self._step(t) for t in new_ids)  # one DecodeStream step per token, as vLLM

    def _step(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        full_text = self._decode(self.token_ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.token_ids)
            self.text += delta
            return delta
        return ""

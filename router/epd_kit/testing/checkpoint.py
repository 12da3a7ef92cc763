"""Build a tiny Qwen3-VL-style checkpoint directory, offline, for tests, the demo and the sim.

The directory has the file names and keys of a real Qwen3-VL checkpoint (config.json,
generation_config.json, preprocessor_config.json, video_preprocessor_config.json,
tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, chat_template.json,
special_tokens_map.json) but no weights. The tokenizer is a byte-level BPE trained here with
`tokenizers` on a built-in corpus, so any UTF-8 text round-trips; Qwen's special tokens come
right after the trained vocabulary, as in Qwen (there at 151643+; here at len(vocab)+).

    python -m epd_kit.testing.checkpoint DIR [--text-only] [--vocab-size N]

`--text-only` writes a Qwen3ForCausalLM checkpoint (no vision config, no image processor):
what an operator gets when $MODEL points at the wrong model (preflight / sim failure tests).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

DEFAULT_VOCAB_SIZE = 1024  # BPE tokens + special tokens; text_config.vocab_size is padded from it

# Qwen's special tokens, in Qwen's id order (<|endoftext|> = 151643 there).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2/3 pre-tokenizer split pattern (contractions, letters, single digits, punctuation, spaces).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Describe this image in one sentence.",
    "What is shown in the picture? A cat sitting on a red chair next to a window.",
    "The router renders the prompt, the vision encoder encodes the image, and the "
    "prefill and decode engine generates the answer.",
    "user assistant system You are a helpful assistant.",
    "Compare the two images and list the differences.",
    "There are 3 apples, 12 oranges and 1024 grapes in 7 baskets.",
    "def main():\n    print('hello world')\n    return 0\n",
    '{"model": "qwen3-vl", "messages": [{"role": "user", "content": "hi"}]}',
    "Encoder disaggregation moves the vision tower onto its own pool of accelerators.",
    "Bonjour, ça va ? Très bien, merci. Déjà vu, naïve café.",
    "Grüße aus München! Über den Fluss und durch die Straße.",
    "你好，世界。这是一张图片。请描述这张图片的内容。",
    "こんにちは世界。これは画像です。",
    "안녕하세요 세계",
    "Привет, мир! Что изображено на картинке?",
    "مرحبا بالعالم",
    "emoji: 😀 🚀 🐈 ✅ ❤️ 👍🏽 🇺🇸",
    "math: α β γ δ ∑ ∫ √ ≤ ≥ ≠ ∞ π ≈ 3.14159",
    "A photo of a mountain lake at sunrise, with mist over the water and pine trees.",
    "The image shows a street scene with cars, bicycles, pedestrians and traffic lights.",
    "Answer briefly. Yes. No. Maybe. I don't know. It's a dog, it's a cat, they're friends.",
)


def chat_template() -> str:
    """A Qwen3-VL-style chat template: one <|vision_start|><|image_pad|><|vision_end|> per image."""
    return (
        "{%- set image_count = namespace(value=0) -%}"
        "{%- set video_count = namespace(value=0) -%}"
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['content'] is string -%}"
        "{{- message['content'] -}}"
        "{%- else -%}"
        "{%- for content in message['content'] -%}"
        "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}"
        "{%- set image_count.value = image_count.value + 1 -%}"
        "{%- if add_vision_id -%}{{- 'Picture ' ~ image_count.value ~ ': ' -}}{%- endif -%}"
        "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
        "{%- elif content['type'] == 'video' or 'video' in content -%}"
        "{%- set video_count.value = video_count.value + 1 -%}"
        "{%- if add_vision_id -%}{{- 'Video ' ~ video_count.value ~ ': ' -}}{%- endif -%}"
        "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
        "{%- elif 'text' in content -%}"
        "{{- content['text'] -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # No NFC normalizer (Qwen has one): here decode(encode(s)) == s for every string.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any UTF-8 round-trips
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _padded(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def build_tiny_checkpoint(path: Path, *, vocab_size: int = DEFAULT_VOCAB_SIZE, text_only: bool = False) -> Path:
    """Write the checkpoint into `path` (created if missing) and return `path`."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tok = _train_tokenizer(vocab_size)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok.save(str(path / "tokenizer.json"))
    tok.model.save(str(path), None)  # vocab.json + merges.txt, as in a real checkpoint
    embed_size = _padded(tok.get_vocab_size(with_added_tokens=True))

    added_tokens_decoder = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    template = chat_template()
    _write_json(
        path / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added_tokens_decoder,
            "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>",)],
            "bos_token": None,
            "chat_template": template,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 262144,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )
    _write_json(path / "chat_template.json", {"chat_template": template})
    _write_json(
        path / "special_tokens_map.json",
        {
            "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
            "eos_token": {
                "content": "<|im_end|>",
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
            },
            "pad_token": {
                "content": "<|endoftext|>",
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
            },
        },
    )
    eos, endoftext = ids["<|im_end|>"], ids["<|endoftext|>"]
    _write_json(
        path / "generation_config.json",
        {
            "bos_token_id": endoftext,
            "pad_token_id": endoftext,
            "do_sample": True,
            "eos_token_id": [eos, endoftext],
            "top_k": 20,
            "top_p": 0.8,
            "temperature": 0.7,
            "repetition_penalty": 1.0,
            "transformers_version": "4.57.0",
        },
    )
    text_fields = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": endoftext,
        "eos_token_id": eos,
        "head_dim": 32,  # vLLM's CPU attention takes head sizes of 32 and up (docs/sim.md)
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 5000000,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": embed_size,
        "dtype": "bfloat16",
    }
    if text_only:
        _write_json(
            path / "config.json",
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "transformers_version": "4.57.0",
                **text_fields,
            },
        )
        return path

    _write_json(
        path / "config.json",
        {
            "architectures": ["Qwen3VLForConditionalGeneration"],
            "model_type": "qwen3_vl",
            "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"],
            "tie_word_embeddings": False,
            "transformers_version": "4.57.0",
            "text_config": {
                **text_fields,
                "model_type": "qwen3_vl_text",
                # vLLM 0.29 builds the language model from text_config (VllmConfig.with_hf_config)
                # and reads its architectures[0]; qwen3_vl_text is not in transformers' causal-LM
                # table it falls back to, so an empty list fails start-up (IndexError)
                "architectures": ["Qwen3ForCausalLM"],
                "rope_scaling": {"mrope_interleaved": True, "mrope_section": [8, 4, 4], "rope_type": "default"},
            },
            "vision_config": {
                "deepstack_visual_indexes": [1, 2, 3],
                "depth": 4,
                "hidden_act": "gelu_pytorch_tanh",
                "hidden_size": 64,
                "in_channels": 3,
                "initializer_range": 0.02,
                "intermediate_size": 128,
                "model_type": "qwen3_vl",
                "num_heads": 4,
                "num_position_embeddings": 2304,
                "out_hidden_size": 64,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
        },
    )
    image_processor = {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }
    _write_json(path / "preprocessor_config.json", image_processor)
    _write_json(
        path / "video_preprocessor_config.json",
        {
            **image_processor,
            "size": {"longest_edge": 25165824, "shortest_edge": 4096},
            "fps": 2,
            "video_processor_type": "Qwen3VLVideoProcessor",
        },
    )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m epd_kit.testing.checkpoint",
        description="Write a tiny Qwen3-VL-style checkpoint directory (no weights, no network).",
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument(
        "--text-only", action="store_true", help="write a Qwen3ForCausalLM (text-only) checkpoint instead"
    )
    args = parser.parse_args(argv)
    try:
        out = build_tiny_checkpoint(args.directory, vocab_size=args.vocab_size, text_only=args.text_only)
    except ValueError as exc:
        parser.error(str(exc))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

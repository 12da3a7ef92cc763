"""What the sim needs from a checkpoint directory: architecture, vision geometry, vocabulary.

Only config.json (+ tokenizer.json for the output vocabulary) is read; no weights exist. The
vision geometry and the error are the preprocessor's (preprocess/model_files.py): one reader.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epd_kit.preprocess.model_files import CheckpointError, VisionGeometry, vision_geometry

# vLLM's built-in default when `vllm serve` gets no model argument (tutorial, "Warning").
VLLM_DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
VLLM_DEFAULT_ARCH = "Qwen3ForCausalLM"

# A token we emit must detokenize to plain readable text: letters, optionally after the
# byte-level BPE space marker "Ġ". Anything else (specials, byte fragments) is avoided.
_PLAIN_TOKEN = re.compile(r"^Ġ?[A-Za-z]{1,16}$")


@dataclass(frozen=True)
class VocabSpace:
    """The token ids the sim may emit: readable, non-special ids of the checkpoint's vocab."""

    vocab_size: int
    allowed_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.allowed_ids:
            raise CheckpointError("the checkpoint vocabulary has no plain tokens to emit")


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    architectures: tuple[str, ...]
    has_vision_config: bool
    vision: VisionGeometry
    vocab: VocabSpace

    @property
    def architecture(self) -> str:
        return self.architectures[0] if self.architectures else "<none>"

    @property
    def is_multimodal(self) -> bool:
        """A vision-language architecture with a vision tower config."""
        arch = self.architecture
        return self.has_vision_config and ("VL" in arch or "ConditionalGeneration" in arch)


def _eos_ids(config: dict[str, Any]) -> tuple[int, ...]:
    raw = config.get("eos_token_id")
    if raw is None:
        return ()
    return tuple(raw) if isinstance(raw, list) else (int(raw),)


def _vocab_space(path: Path, vocab_size: int, eos: tuple[int, ...]) -> VocabSpace:
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        banned = set(eos)
        ids = tuple(i for i in range(min(vocab_size, 1 << 20)) if i not in banned)
        return VocabSpace(vocab_size=vocab_size, allowed_ids=ids)
    doc = json.loads(tok_file.read_text(encoding="utf-8"))
    specials = {int(t["id"]) for t in doc.get("added_tokens", [])}
    vocab: dict[str, int] = (doc.get("model") or {}).get("vocab") or {}
    ids = sorted(
        i
        for tok, i in vocab.items()
        if _PLAIN_TOKEN.match(tok) and i not in specials and i < vocab_size and i not in eos
    )
    return VocabSpace(vocab_size=vocab_size, allowed_ids=tuple(ids))


def load_checkpoint(path: Path) -> CheckpointInfo:
    """Read `path/config.json` (and tokenizer.json). Raises CheckpointError if unusable."""
    cfg_file = Path(path) / "config.json"
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"{cfg_file} does not exist") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{cfg_file} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_file} must hold a JSON object")
    text_config = config.get("text_config") or config
    vocab_size = int(text_config.get("vocab_size") or config.get("vocab_size") or 0)
    if vocab_size <= 0:
        raise CheckpointError(f"{cfg_file} has no vocab_size (text_config.vocab_size)")
    eos = _eos_ids(text_config) or _eos_ids(config)
    vision_config = config.get("vision_config")
    return CheckpointInfo(
        path=Path(path),
        architectures=tuple(config.get("architectures") or ()),
        has_vision_config=isinstance(vision_config, dict),
        vision=vision_geometry(vision_config if isinstance(vision_config, dict) else {}, cfg_file),
        vocab=_vocab_space(Path(path), vocab_size, eos),
    )

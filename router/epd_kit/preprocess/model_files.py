"""Read what preprocessing needs from a checkpoint directory (local files only, no hub).

Accepts the layout of a real Qwen3-VL checkpoint (and Qwen2/2.5-VL, same keys):
config.json, preprocessor_config.json, tokenizer.json, tokenizer_config.json, and the chat
template from chat_template.jinja, chat_template.json or tokenizer_config.json (first found,
the order transformers 5 uses). A checkpoint without vision_config is text-only.

The dtype pixel_values travel in is the engine's model dtype, resolved as vLLM resolves
`--dtype` (`engine_dtype`, "auto" by default) against the checkpoint's own: vLLM's processor
casts pixel_values to it before they leave, so a VE receives what it computes in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# transformers' Qwen2-VL image processor defaults, for keys a preprocessor_config omits
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3

# vLLM's --dtype spellings -> the torch dtype name the wire carries
ENGINE_DTYPES = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "float": "float32",
}
# `--dtype auto` keeps a 16-bit checkpoint's dtype and runs a float32 (or unlabelled) one in
# the platform's preferred dtype, bfloat16 on Neuron (vLLM `_resolve_auto_dtype`)
_AUTO_FROM_FLOAT32 = "bfloat16"


class CheckpointError(ValueError):
    """The directory is not a usable checkpoint; the message names the file and key."""


# Qwen3VLVisionConfig's defaults, the class vLLM reads a Qwen3-VL config.json with (transformers
# 5.24 models/qwen3_vl/configuration_qwen3_vl.py), for a vision_config key a checkpoint leaves out
QWEN3_VL_VISION_DEFAULTS = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
    "out_hidden_size": 3584,
    "deepstack_visual_indexes": [8, 16, 24],
}


@dataclass(frozen=True)
class VisionGeometry:
    """The vision tower's patch and embedding geometry (config.json vision_config)."""

    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int
    deepstack_levels: int

    @property
    def merge_factor(self) -> int:
        return self.spatial_merge_size**2

    @property
    def patch_dim(self) -> int:
        """Values per raw patch row of pixel_values (3·2·16·16 = 1536 for Qwen3-VL)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def fat_dim(self) -> int:
        """Embedding row width the encoder cache stores (main + deepstack levels)."""
        return self.out_hidden_size * (1 + self.deepstack_levels)


def vision_geometry(vision_config: dict[str, Any], where: Path | None = None) -> VisionGeometry:
    """The geometry `vision_config` (of the config.json at `where`) declares: the one reader of
    it, for the preprocessor and the simulated engine alike; `{}` gives Qwen3-VL's defaults."""

    def value(key: str) -> Any:
        found = vision_config.get(key, QWEN3_VL_VISION_DEFAULTS[key])
        wanted = list if key == "deepstack_visual_indexes" else int
        if not isinstance(found, wanted) or isinstance(found, bool) or (wanted is int and found <= 0):
            what = "a list" if wanted is list else "a positive integer"
            raise CheckpointError(f"{where or 'config.json'}: vision_config '{key}' must be {what}, got {found!r}")
        return found

    return VisionGeometry(
        patch_size=value("patch_size"),
        temporal_patch_size=value("temporal_patch_size"),
        spatial_merge_size=value("spatial_merge_size"),
        in_channels=value("in_channels"),
        out_hidden_size=value("out_hidden_size"),
        deepstack_levels=len(value("deepstack_visual_indexes")),
    )


@dataclass(frozen=True)
class VisionSettings:
    """Everything that determines pixel_values and placeholder counts for an image."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    do_normalize: bool
    image_token_id: int
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    pixel_dtype: str = "float32"  # torch dtype name pixel_values are sent in (ENGINE_DTYPES)

    @property
    def factor(self) -> int:
        """Resize granularity: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def pixel_settings(self) -> dict[str, Any]:
        """The settings that change pixel_values (part of the content hash)."""
        return {
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "rescale_factor": self.rescale_factor,
            "do_normalize": self.do_normalize,
            "resample": "bicubic",
            "dtype": self.pixel_dtype,
        }


@dataclass(frozen=True)
class CheckpointFiles:
    path: Path
    architecture: str
    model_type: str
    tokenizer_file: Path
    chat_template: str
    special_tokens: dict[str, str]  # bos_token/eos_token/pad_token/unk_token -> text
    eos_token_strings: tuple[str, ...]
    eos_token_ids_config: tuple[int, ...]  # from config.json / generation_config.json
    vision: VisionSettings | None
    # the language model's output rows (text_config.vocab_size; 0 if absent): Qwen pads them
    # beyond the tokenizer's vocabulary (151936 rows for ~151.7 k tokens), and vLLM samples
    # over all of them
    model_vocab_size: int = 0

    @classmethod
    def load(cls, path: str | Path, *, engine_dtype: str = "auto") -> CheckpointFiles:
        """`engine_dtype`: the engines' `--dtype` (router.yaml `dtype`)."""
        root = Path(path)
        if not root.is_dir():
            raise CheckpointError(f"checkpoint directory {root} does not exist")
        config = _read_json(root / "config.json", required=True)
        tok_config = _read_json(root / "tokenizer_config.json", required=False)
        gen_config = _read_json(root / "generation_config.json", required=False)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(
                f"{root} has no tokenizer.json (the fast-tokenizer file every Qwen checkpoint "
                "ships); copy it from the model repository"
            )
        architectures = config.get("architectures") or ["unknown"]
        special = {
            key: text
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (text := _token_text(tok_config.get(key))) is not None
        }
        text_config = config.get("text_config") or config
        eos_ids = _int_list(gen_config.get("eos_token_id")) + _int_list(text_config.get("eos_token_id"))
        vision = None
        if "vision_config" in config:
            vision = _vision_settings(root, config, resolve_dtype(engine_dtype, config, root))
        return cls(
            path=root,
            architecture=str(architectures[0]),
            model_type=str(config.get("model_type", "")),
            tokenizer_file=tokenizer_file,
            chat_template=_chat_template(root, tok_config),
            special_tokens=special,
            eos_token_strings=tuple(t for t in [special.get("eos_token")] if t),
            eos_token_ids_config=tuple(dict.fromkeys(eos_ids)),
            vision=vision,
            model_vocab_size=vocab if isinstance(vocab := text_config.get("vocab_size"), int) else 0,
        )


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path} is missing")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _int_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _chat_template(root: Path, tok_config: dict[str, Any]) -> str:
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = _read_json(root / "chat_template.json", required=False)
    template = as_json.get("chat_template") or tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise CheckpointError(
            f"{root} has no chat template (looked in chat_template.jinja, chat_template.json "
            "and tokenizer_config.json 'chat_template')"
        )
    return template


def resolve_dtype(engine_dtype: str, config: dict[str, Any], root: Path) -> str:
    """The dtype the engine's model runs in: `engine_dtype` unless "auto", else the
    checkpoint's (config.json `dtype`/`torch_dtype`, then text_config's and vision_config's,
    the order vLLM looks in), as vLLM resolves it."""
    if engine_dtype != "auto":
        if engine_dtype not in ENGINE_DTYPES:
            raise CheckpointError(f"dtype {engine_dtype!r} is not one of auto, {', '.join(ENGINE_DTYPES)}")
        return ENGINE_DTYPES[engine_dtype]
    sections = (config, config.get("text_config") or {}, config.get("vision_config") or {})
    declared = next(
        (c[key] for c in sections for key in ("dtype", "torch_dtype") if isinstance(c.get(key), str)), "float32"
    )
    resolved = ENGINE_DTYPES.get(declared.removeprefix("torch."))
    if resolved is None:
        raise CheckpointError(f"{root / 'config.json'}: dtype {declared!r} is not a float dtype vLLM runs in")
    return _AUTO_FROM_FLOAT32 if resolved == "float32" else resolved


def _vision_settings(root: Path, config: dict[str, Any], pixel_dtype: str) -> VisionSettings:
    pre = _read_json(root / "preprocessor_config.json", required=True)
    vcfg = config["vision_config"] or {}
    where = root / "preprocessor_config.json"

    def num(key: str, default: Any) -> Any:
        value = pre.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise CheckpointError(f"{where}: '{key}' must be a number, got {value!r}")
        return value

    geometry = vision_geometry(vcfg, root / "config.json")
    patch = int(num("patch_size", geometry.patch_size))
    merge = int(num("merge_size", geometry.spatial_merge_size))
    temporal = int(num("temporal_patch_size", geometry.temporal_patch_size))
    for key, ours in (("patch_size", patch), ("spatial_merge_size", merge), ("temporal_patch_size", temporal)):
        theirs = vcfg.get(key)
        if theirs is not None and int(theirs) != ours:
            raise CheckpointError(f"{where} and config.json vision_config disagree on {key}: {ours} vs {theirs}")
    size = pre.get("size") or {}
    min_pixels = int(size.get("shortest_edge", pre.get("min_pixels", 56 * 56)))
    max_pixels = int(size.get("longest_edge", pre.get("max_pixels", 28 * 28 * 1280)))
    if not 0 < min_pixels <= max_pixels:
        raise CheckpointError(f"{where}: need 0 < min_pixels ({min_pixels}) <= max_pixels ({max_pixels})")
    resample = pre.get("resample", _BICUBIC)
    if resample != _BICUBIC:
        raise CheckpointError(f"{where}: resample {resample!r} is not supported (only 3 = bicubic)")
    if pre.get("do_resize", True) is False or pre.get("do_convert_rgb", True) is False:
        raise CheckpointError(f"{where}: do_resize/do_convert_rgb false is not supported")
    mean = tuple(float(x) for x in pre.get("image_mean", _CLIP_MEAN))
    std = tuple(float(x) for x in pre.get("image_std", _CLIP_STD))
    if len(mean) != 3 or len(std) != 3 or any(s == 0 for s in std):
        raise CheckpointError(f"{where}: image_mean/image_std need 3 values (std non-zero)")
    do_rescale = pre.get("do_rescale", True)
    image_token_id = config.get("image_token_id")
    if not isinstance(image_token_id, int):
        raise CheckpointError(f"{root / 'config.json'}: a vision model needs an integer image_token_id")
    return VisionSettings(
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=temporal,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        image_mean=mean,  # type: ignore[arg-type]
        image_std=std,  # type: ignore[arg-type]
        rescale_factor=float(num("rescale_factor", 1 / 255)) if do_rescale else 1.0,
        do_normalize=bool(pre.get("do_normalize", True)),
        image_token_id=image_token_id,
        vision_start_token_id=config.get("vision_start_token_id"),
        vision_end_token_id=config.get("vision_end_token_id"),
        pixel_dtype=pixel_dtype,
    )

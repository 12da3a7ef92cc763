"""The tiny checkpoint builder and the checkpoint loader (tiny and real Qwen3-VL layouts)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from epd_kit.preprocess import CheckpointError, CheckpointFiles
from epd_kit.testing.checkpoint import SPECIAL_TOKENS, build_tiny_checkpoint
from tests.budget import scaled

REAL_LAYOUT = {  # file names of Qwen/Qwen3-VL-*-Instruct (weights aside)
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
}


def test_layout_and_keys(checkpoint: Path) -> None:
    assert {p.name for p in checkpoint.iterdir()} >= REAL_LAYOUT
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert config["model_type"] == "qwen3_vl"
    vision = config["vision_config"]
    assert (vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]) == (16, 2, 2)
    assert vision["deepstack_visual_indexes"] and vision["out_hidden_size"] > 0
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    assert config["image_token_id"] == tok.token_to_id("<|image_pad|>")
    assert config["vision_start_token_id"] == tok.token_to_id("<|vision_start|>")
    assert config["text_config"]["eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert config["text_config"]["vocab_size"] >= tok.get_vocab_size(with_added_tokens=True)
    pre = json.loads((checkpoint / "preprocessor_config.json").read_text())
    assert pre["size"] == {"longest_edge": 16777216, "shortest_edge": 65536}
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (16, 2, 2)
    # special tokens sit right after the trained vocabulary, in Qwen's order
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(ids[0], ids[0] + len(SPECIAL_TOKENS)))


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80) | st.sampled_from(["e\u0301", "😀👍🏽🇺🇸", "你好 мир \x00\t"]))
def test_tokenizer_round_trips_any_utf8(checkpoint: Path, text: str) -> None:
    tok = _tokenizer(checkpoint)
    if any(s in text for s in SPECIAL_TOKENS):
        return
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


_TOKENIZERS: dict[Path, Tokenizer] = {}


def _tokenizer(path: Path) -> Tokenizer:
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = Tokenizer.from_file(str(path / "tokenizer.json"))
    return _TOKENIZERS[path]


def test_transformers_loads_it_offline(checkpoint: Path) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    )
    proc = AutoImageProcessor.from_pretrained(str(checkpoint), local_files_only=True)
    assert proc.patch_size == 16 and proc.merge_size == 2


def test_text_only_variant(text_only_checkpoint: Path) -> None:
    config = json.loads((text_only_checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert "vision_config" not in config
    assert not (text_only_checkpoint / "preprocessor_config.json").exists()
    files = CheckpointFiles.load(text_only_checkpoint)
    assert files.vision is None and files.architecture == "Qwen3ForCausalLM"


def test_cli_writes_a_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "cli-ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "epd_kit.testing.checkpoint", str(out)],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert CheckpointFiles.load(out).vision is not None
    bad = subprocess.run(
        [sys.executable, "-m", "epd_kit.testing.checkpoint", str(out), "--vocab-size", "10"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        check=False,
    )
    assert bad.returncode == 2 and "vocab_size must be at least" in bad.stderr


def test_builder_is_deterministic(tmp_path: Path, checkpoint: Path) -> None:
    again = build_tiny_checkpoint(tmp_path / "again")
    for name in ("tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (checkpoint / name).read_bytes(), name


def test_loader_finds_the_template_where_real_checkpoints_keep_it(tmp_path: Path, checkpoint: Path) -> None:
    template = json.loads((checkpoint / "chat_template.json").read_text())["chat_template"]
    # transformers 5 layout: chat_template.jinja wins over the others
    jinja_dir = _copy(checkpoint, tmp_path / "jinja")
    (jinja_dir / "chat_template.jinja").write_text("JINJA {{ messages[0]['content'] }}")
    assert CheckpointFiles.load(jinja_dir).chat_template.startswith("JINJA")
    # Qwen2.5-VL layout: only in tokenizer_config.json
    tc_dir = _copy(checkpoint, tmp_path / "tc")
    (tc_dir / "chat_template.json").unlink()
    assert CheckpointFiles.load(tc_dir).chat_template == template
    # named templates list
    tc = json.loads((tc_dir / "tokenizer_config.json").read_text())
    tc["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "D"}]
    (tc_dir / "tokenizer_config.json").write_text(json.dumps(tc))
    assert CheckpointFiles.load(tc_dir).chat_template == "D"


def test_loader_accepts_legacy_min_max_pixels(tmp_path: Path, checkpoint: Path) -> None:
    d = _copy(checkpoint, tmp_path / "legacy")
    pre = json.loads((d / "preprocessor_config.json").read_text())
    del pre["size"]
    pre.update(min_pixels=3136, max_pixels=1003520)
    (d / "preprocessor_config.json").write_text(json.dumps(pre))
    vision = CheckpointFiles.load(d).vision
    assert vision is not None and (vision.min_pixels, vision.max_pixels) == (3136, 1003520)


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d: (d / "config.json").unlink(), "config.json is missing"),
        (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
        (lambda d: (d / "preprocessor_config.json").unlink(), "preprocessor_config.json is missing"),
        (lambda d: (d / "config.json").write_text("{not json"), "not readable JSON"),
        (lambda d: _drop_templates(d), "no chat template"),  # noqa: PLW0108 (defined below)
        (lambda d: _edit(d, "preprocessor_config.json", patch_size=14), "disagree on patch_size"),
    ],
)
def test_loader_errors_name_the_problem(tmp_path: Path, checkpoint: Path, breakage, message: str) -> None:
    d = _copy(checkpoint, tmp_path / "broken")
    breakage(d)
    with pytest.raises(CheckpointError, match=message):
        CheckpointFiles.load(d)


def test_loader_rejects_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointFiles.load(tmp_path / "nope")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(d: Path, name: str, **changes: object) -> None:
    data = json.loads((d / name).read_text())
    data.update(changes)
    (d / name).write_text(json.dumps(data))


def _drop_templates(d: Path) -> None:
    (d / "chat_template.json").unlink()
    _edit(d, "tokenizer_config.json", chat_template=None)


def test_the_vision_geometry_has_one_reader_one_error_and_qwen3_vls_defaults(tmp_path):
    """preprocess/model_files.py reads config.json's vision_config for the preprocessor and the
    simulated engine alike: a key left out takes Qwen3VLVisionConfig's default (the config
    class vLLM loads a Qwen3-VL checkpoint with), a bad value is the one CheckpointError."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    from epd_kit.preprocess.model_files import vision_geometry
    from epd_kit.sim import checkpoint as sim_checkpoint

    reference = Qwen3VLVisionConfig()
    geometry = vision_geometry({}, tmp_path / "config.json")
    assert (geometry.patch_size, geometry.temporal_patch_size, geometry.spatial_merge_size) == (
        reference.patch_size,
        reference.temporal_patch_size,
        reference.spatial_merge_size,
    )
    assert (geometry.in_channels, geometry.out_hidden_size, geometry.deepstack_levels) == (
        reference.in_channels,
        reference.out_hidden_size,
        len(reference.deepstack_visual_indexes),
    )
    assert sim_checkpoint.CheckpointError is CheckpointError
    assert sim_checkpoint.VisionGeometry is type(geometry)
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["X"], "vocab_size": 8, "vision_config": {"patch_size": "16"}})
    )
    with pytest.raises(CheckpointError, match="vision_config 'patch_size' must be a positive integer"):
        sim_checkpoint.load_checkpoint(tmp_path)

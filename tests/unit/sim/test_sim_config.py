"""vllm serve flags + env -> engine config, and the startup failures of the real engine."""

from __future__ import annotations

import dataclasses

import pytest
from sim_args import config, pd_args, ve_args

from epd_kit.sim.config import StartupFailure, build_engine_config, parse_visible_devices


def test_tutorial_ve_and_pd(tiny_ckpt) -> None:
    ve = config(ve_args(str(tiny_ckpt)), "8,9,10,11")
    pd = config(pd_args(str(tiny_ckpt)), "0-7")
    assert (ve.role, pd.role) == ("ve", "pd")
    assert ve.engine_id == "epd-ve-0" and ve.side_channel_port == 14600
    assert ve.vision_dp == 4 and ve.encoder_cache_num_blocks == 128
    assert pd.transfer_timeout_s == 1.0 and pd.max_num_seqs == 8
    assert ve.block_len == pd.block_len
    assert not ve.slice_misaligned and not pd.slice_misaligned
    assert ve.efa_env_ok and not ve.enable_prefix_caching


def test_block_len_is_10_mib_for_qwen3_vl_32b(qwen32b_config_dir) -> None:
    cfg = config(pd_args(str(qwen32b_config_dir)), "0-7")
    assert cfg.block_tokens == 256 and cfg.vision.fat_dim == 20480
    assert cfg.block_len == 10 * 1024 * 1024  # docs/contract.md §2.4


def test_visible_devices_forms() -> None:
    assert parse_visible_devices("8,9,10,11") == (8, 9, 10, 11)
    assert parse_visible_devices("0-3,8") == (0, 1, 2, 3, 8)


def test_tp_must_equal_visible_cores(tiny_ckpt) -> None:
    with pytest.raises(StartupFailure) as err:
        config(pd_args(str(tiny_ckpt)), "0,1,2,3")
    assert err.value.exc_type == "AssertionError"
    assert "TP (8) != len(NEURON_VISIBLE_DEVICES) (4)" in err.value.message


def test_misaligned_slice_is_only_detected_later(tiny_ckpt) -> None:
    cfg = config(pd_args(str(tiny_ckpt)), "4-11")  # builds fine: fails in warmup
    assert cfg.slice_misaligned


def test_roles(tiny_ckpt) -> None:
    both = pd_args(str(tiny_ckpt), mm_encoder_only=True)
    with pytest.raises(StartupFailure, match="mutually exclusive") as err:
        config(both, "0-7")
    assert err.value.exc_type == "ValueError"
    nested = pd_args(str(tiny_ckpt), additional_config={"neuron_config": {"mm_language_model_only": True}})
    with pytest.raises(StartupFailure, match="nested inside another dict is ignored"):
        config(nested, "0-7")
    wrong_role = ve_args(str(tiny_ckpt), ec_transfer_config={"ec_role": "ec_consumer"})
    with pytest.raises(StartupFailure, match="ec_producer"):
        config(wrong_role, "8-11")


@pytest.mark.parametrize("model", [None, "", "/does/not/exist"])
def test_no_model_is_the_text_only_default(model) -> None:
    with pytest.raises(StartupFailure) as err:
        config(ve_args(model), "8-11")
    assert str(err.value) == (
        "TypeError: Qwen3ForCausalLM.from_configs() got an unexpected keyword argument 'text_neuron_config'"
    )


def test_prefix_caching_defaults_on_like_vllm(tiny_ckpt) -> None:
    assert config(pd_args(str(tiny_ckpt), enable_prefix_caching=None), "0-7").enable_prefix_caching
    assert config(pd_args(str(tiny_ckpt), enable_prefix_caching=True), "0-7").enable_prefix_caching


def test_efa_env_must_have_the_required_values(tiny_ckpt) -> None:
    args = pd_args(str(tiny_ckpt))
    assert not build_engine_config(args, {"NEURON_VISIBLE_DEVICES": "0-7"}).efa_env_ok
    assert not config(args, "0-7", FI_EFA_USE_DEVICE_RDMA="0").efa_env_ok


def test_encoder_cache_floor_is_raised(tiny_ckpt) -> None:
    vision = {"vision_attention_block_size": 1024, "encoder_cache_num_blocks": 4}
    cfg = config(ve_args(str(tiny_ckpt), additional_config={"vision_neuron_config": vision}), "8-11")
    assert cfg.encoder_cache_num_blocks == 8192 // 256 + 1
    assert any("is too small" in w for w in cfg.warnings)


def test_serve_args_are_frozen(tiny_ckpt) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ve_args(str(tiny_ckpt)).port = 1  # type: ignore[misc]

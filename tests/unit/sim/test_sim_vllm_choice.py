"""The vLLM a simulated engine answers as (epd_kit/sim/release.py): which one EPD_SIM_VLLM names,
and the stand-in compiler versions that follow it into the compile cache key."""

from __future__ import annotations

import pytest

from epd_kit.plan.neuron_releases import RELEASES
from epd_kit.sim import compile_cache as cc
from epd_kit.sim.release import answer_shape, sim_sdk

KEY = {"architecture": "Qwen3VLForConditionalGeneration", "role": "pd", "shapes": {"max_num_seqs": 4}, "tp": 8}


@pytest.mark.parametrize(("value", "vllm"), [("", "0.24"), ("0.24", "0.24"), ("0.29", "0.29"), ("0.29.0", "0.29")])
def test_the_variable_names_the_vllm_unset_is_the_default_releases(value, vllm):
    assert answer_shape({"EPD_SIM_VLLM": value} if value else {}).vllm == vllm


def test_each_supported_release_has_its_vllm_and_nothing_else_is_accepted():
    assert {answer_shape({"EPD_SIM_VLLM": r.vllm}).vllm for r in RELEASES.values()} == {"0.24", "0.29"}
    said = r"EPD_SIM_VLLM='0\.25': the simulated engine answers as vLLM 0\.24, 0\.29 or 0\.32"
    with pytest.raises(ValueError, match=said):
        answer_shape({"EPD_SIM_VLLM": "0.25"})


def test_a_release_change_changes_the_compile_cache_key_as_its_compiler_does():
    """Neuron 2.32's neuronx-cc 2.27 -> 2.33's 2.28: every key changes (compilation_cache.md "Cache Key")."""
    assert sim_sdk({}) == "2.27-sim" and sim_sdk({"EPD_SIM_VLLM": "0.29"}) == "2.28-sim"
    old = cc.cache_key(cc.key_inputs(target="trn2", env={"EPD_SIM_VLLM": "0.24"}, **KEY))
    new = cc.cache_key(cc.key_inputs(target="trn2", env={"EPD_SIM_VLLM": "0.29"}, **KEY))
    assert old != new and old == cc.cache_key(cc.key_inputs(target="trn2", env={}, **KEY))
    # an explicit simulated SDK still wins
    pinned = cc.key_inputs(target="trn2", env={"EPD_SIM_VLLM": "0.29", "EPD_SIM_NEURON_SDK": "x"}, **KEY)
    assert pinned["neuronxcc"] == "x"


@pytest.mark.parametrize(
    ("value", "handoff", "opt_in"),
    [("0.24", "ec_locator", False), ("0.29", "ec_locator", False), ("0.32", "ec_transfer_params", True)],
)
def test_a_0_3x_sim_speaks_upstreams_handoff_and_serves_the_route_only_when_asked(value, handoff, opt_in):
    """vLLM 0.30+ hands items over ec_transfer_params and needs --enable-scale-out
    (docs/sim.md "Hand-offs"); 0.32 is not a Neuron release's: its compiler stand-in is the
    newest release's."""
    shape = answer_shape({"EPD_SIM_VLLM": value})
    assert (shape.vllm, shape.handoff, shape.scale_out_opt_in) == (value, handoff, opt_in)
    assert sim_sdk({"EPD_SIM_VLLM": "0.32"}) == sim_sdk({"EPD_SIM_VLLM": "0.29"})

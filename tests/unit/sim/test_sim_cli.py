"""The command line: vLLM's flags, vLLM's error for unknown ones, sim options from env."""

from __future__ import annotations

from click.testing import CliRunner

from epd_kit.sim.cli import main
from tests.golden.tutorial import TUTORIAL_FLAGS


def test_help_lists_every_tutorial_flag_and_sim_env() -> None:
    out = CliRunner().invoke(main, ["serve", "--help"]).output
    for flag in TUTORIAL_FLAGS:
        assert flag in out
    assert "EPD_SIM_PROFILE" in out and "EPD_SIM_CRASH_AFTER" in out


def test_unknown_flag_is_an_error() -> None:
    res = CliRunner().invoke(main, ["serve", "/m", "--enable-magic"])
    assert res.exit_code == 2 and "unrecognized arguments: --enable-magic" in res.output


def test_bad_json_flag() -> None:
    res = CliRunner().invoke(main, ["serve", "/m", "--additional-config", "{nope"])
    assert res.exit_code == 2 and "invalid JSON" in res.output


def test_bad_sim_env_value() -> None:
    res = CliRunner().invoke(main, ["serve", "/m"], env={"EPD_SIM_PROFILE": "warp"})
    assert res.exit_code == 2 and "'warp' is not one of" in res.output

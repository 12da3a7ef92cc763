"""epd_otlp_traces_endpoint: one collector URL for the router (router.yaml tracing) and every engine
(vLLM's --otlp-traces-endpoint over OTLP/HTTP), nothing of it when unset, and no second way to set
either (epd_extra_args, epd_engine_environment)."""

from __future__ import annotations

import pytest

from epd_kit import plan as planner
from epd_kit.router_yaml import parse_config
from epd_kit.sim.cli import serve
from tests.unit.plan.test_checks import check

URL = "http://10.0.0.9:4318/v1/traces"


def planned(change):
    result = check(change)
    assert result["problems"] == [], result["problems"]
    settings = planner.read_settings(result["settings"])
    config = planner.router_config(result["plan"], settings, listen_host="127.0.0.1")
    return result["plan"]["n1"]["engines"], config


def test_a_named_collector_reaches_every_engine_and_the_router():
    engines, config = planned({"all": {"epd_otlp_traces_endpoint": URL}})
    assert {e["role"] for e in engines} == {"ve", "pd"}
    for engine in engines:
        argv = engine["argv"]
        assert argv[argv.index("--otlp-traces-endpoint") + 1] == URL, engine["engine_id"]
        assert engine["env"]["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert parse_config(config).tracing.otlp_traces_endpoint == URL


def test_unset_there_is_no_flag_no_environment_and_no_router_section():
    engines, config = planned({})
    for engine in engines:
        assert "--otlp-traces-endpoint" not in engine["argv"]
        assert not [name for name in engine["env"] if name.startswith("OTEL_")]
    assert "tracing" not in config
    assert parse_config(config).tracing.otlp_traces_endpoint is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"epd_extra_args": ["--otlp-traces-endpoint=http://x:4318/v1/traces"]},
            "the kit derives --otlp-traces-endpoint itself; change epd_otlp_traces_endpoint",
        ),
        (
            {"epd_engine_environment": {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}},
            "epd_engine_environment sets OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: the kit derives it",
        ),
    ],
)
def test_a_second_way_to_set_it_is_refused(change, message):
    result = check({"all": change})
    assert result["plan"] is None
    assert any(message in problem for problem in result["problems"]), result["problems"]


def test_the_sim_takes_the_flag_as_vllm_does():
    """vLLM's spelling (vllm/engine/arg_utils.py: --otlp-traces-endpoint, one value)."""
    params = {p.name: p for p in serve.params}
    option = params["otlp_traces_endpoint"]
    assert option.opts == ["--otlp-traces-endpoint"] and option.nargs == 1 and option.default is None


def test_the_sample_ratio_goes_through_the_router_extra_config_checked_by_the_router():
    result = check({"all": {"epd_otlp_traces_endpoint": URL}})
    settings = planner.read_settings(result["settings"])
    extra = {"tracing": {"sample_ratio": 0.1}}  # epd_router_extra_config, merged key by key
    config = planner.router_config(result["plan"], settings, listen_host="127.0.0.1", extra=extra)
    tracing = parse_config(config).tracing
    assert (tracing.otlp_traces_endpoint, tracing.sample_ratio) == (URL, 0.1)
    result = check({"n1": {"epd_router_extra_config": {"tracing": {"sample_ratio": 2}}}})
    assert any("tracing.sample_ratio is 2: input should be less than or equal to 1" in p for p in result["problems"])
    result = check({"n1": {"epd_router_extra_config": {"tracing": {"otlp_traces_endpoint": URL}}}})
    assert any("set that instead" in p and "epd_otlp_traces_endpoint" in p for p in result["problems"])


def test_trust_parent_sampled_is_the_router_variable_s_and_only_with_traces_on():
    """epd_router_trust_parent_sampled (off by default) writes router.yaml tracing.trust_parent_sampled
    when traces are on; epd_router_extra_config may not set it a second way; a bad value is refused."""
    result = check({"all": {"epd_otlp_traces_endpoint": URL}})
    settings = planner.read_settings(result["settings"])
    default = planner.router_config(result["plan"], settings, listen_host="127.0.0.1")
    assert "trust_parent_sampled" not in default["tracing"]
    assert parse_config(default).tracing.trust_parent_sampled is False
    trusted = planner.router_config(result["plan"], settings, listen_host="127.0.0.1", trust_parent_sampled=True)
    assert parse_config(trusted).tracing.trust_parent_sampled is True
    off = check({})
    config = planner.router_config(
        off["plan"], planner.read_settings(off["settings"]), listen_host="127.0.0.1", trust_parent_sampled=True
    )
    assert "tracing" not in config  # nothing to sample without a collector
    result = check({"n1": {"epd_router_extra_config": {"tracing": {"trust_parent_sampled": True}}}})
    assert any("set that instead" in p and "epd_router_trust_parent_sampled" in p for p in result["problems"])
    result = check({"n1": {"epd_router_trust_parent_sampled": "sometimes"}})
    assert any("epd_router_trust_parent_sampled" in p for p in result["problems"]), result["problems"]

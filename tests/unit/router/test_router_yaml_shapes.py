"""router.yaml in one list (issue 57): every model an entry of `models` with its own endpoints; a
file written by the release before (the recorded renders of f3f3a81 under
tests/golden/router-yaml-f3f3a81, one model at the top level, the others' pools under
`endpoints.models`) loads as the same models and passes check-config; a problem names the key the
file has; the roll decision reads both shapes alike (plan/router_shape.py restart_view)."""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from epd_kit.plan.router_shape import models_as_list, restart_view
from epd_kit.router.cli import main
from epd_kit.router.service import RouterService
from epd_kit.router_yaml import ConfigError, parse_config

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "router-yaml-f3f3a81"
# the sandbox inventories main rendered at f3f3a81 (playbooks/render.yml), as recorded
OLD_FILES = sorted(GOLDEN.glob("*.yaml"))


def old(name: str) -> dict:
    return yaml.safe_load((GOLDEN / f"{name}.yaml").read_text())


def one_list(doc: dict) -> dict:
    """The same file written in the one-list shape, as this release's render writes it."""
    data, _ = models_as_list(doc)
    return data


def service_warnings(caplog) -> list[str]:
    """The service's own warnings: caplog holds every logger's records, and a span exporter an
    earlier test left in this process may log "Failed to export spans batch" meanwhile (the
    loaded run of d9364c0)."""
    return [r.getMessage() for r in caplog.records if r.name == "epd_router.service" and r.levelno >= logging.WARNING]


def test_the_recorded_files_are_the_old_shape():
    assert [p.stem for p in OLD_FILES] == ["one-host", "text-only", "two-models"]
    for path in OLD_FILES:
        doc = yaml.safe_load(path.read_text())
        assert "model" in doc and "endpoints" in doc, path.name


@pytest.mark.parametrize("path", OLD_FILES, ids=lambda p: p.stem)
def test_a_file_of_the_release_before_passes_check_config(path):
    result = CliRunner().invoke(main, ["check-config", str(path)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"OK {path}: model ")


def test_the_old_shape_loads_as_the_same_models_in_order():
    cfg = parse_config(old("two-models"))
    assert [(m.name, m.model) for m in cfg.models] == [
        ("vision", "/models/tiny-qwen3-vl"),
        ("text", "/models/tiny-qwen3-vl"),
    ]
    vision, text = (cfg.lane_config(m.name) for m in cfg.models)
    assert [e.id for e in vision.endpoints.ve] == ["epd-ve-0"] and [e.id for e in vision.endpoints.pd] == ["epd-pd-0"]
    assert text.endpoints.text_only and [e.id for e in text.endpoints.pd] == ["epd-text-pd-0"]
    assert vision.limits.images_per_prompt == text.limits.images_per_prompt == 30
    assert cfg.model_name == "vision"  # a request without `model`: the one listed first
    one = parse_config(old("one-host"))
    assert [m.name for m in one.models] == ["/models/tiny-qwen3-vl"]  # no served name: the checkpoint
    assert parse_config(old("text-only")).endpoints.text_only


@pytest.mark.parametrize("path", OLD_FILES, ids=lambda p: p.stem)
def test_both_shapes_parse_to_the_same_config_and_roll_nothing(path):
    doc = yaml.safe_load(path.read_text())
    new = one_list(doc)
    assert not any(key in new for key in ("model", "served_model_name", "quantization", "endpoints"))
    assert parse_config(doc) == parse_config(new)
    assert restart_view(doc) == restart_view(new)
    # a section the processes read at start does roll; an endpoint alone does not
    changed = copy.deepcopy(new)
    changed["models"][0]["endpoints"]["pd"][0]["state"] = "draining"
    assert restart_view(changed) == restart_view(doc)
    changed["models"][-1]["limits"] = {**changed["models"][-1].get("limits", {}), "images_per_prompt": 2}
    assert restart_view(changed) != restart_view(doc)


def test_the_one_list_names_its_own_keys_and_the_old_shape_its_own():
    new = one_list(old("two-models"))
    new["models"][1]["endpoints"]["pd"][0]["state"] = "paused"
    with pytest.raises(ConfigError, match=re.escape("models.1.endpoints.pd.0.state")):
        parse_config(new, "router.yaml")
    doc = old("two-models")
    doc["endpoints"]["models"]["text"]["pd"][0]["state"] = "paused"
    with pytest.raises(ConfigError, match=re.escape("endpoints.models.text.pd.0.state")):
        parse_config(doc, "router.yaml")
    doc = old("two-models")
    doc["models"][0]["model"] = ""
    with pytest.raises(ConfigError, match=re.escape("  models.0.model: String should have at least 1 character")):
        parse_config(doc, "router.yaml")
    doc = old("one-host")
    del doc["model"]
    with pytest.raises(ConfigError) as info:
        parse_config(doc, "router.yaml")
    assert str(info.value).splitlines()[1:] == ["  model: required key is missing"]  # once, in the file's terms


def test_the_one_list_refuses_a_mix_an_empty_list_and_a_served_name_twice():
    doc = old("two-models")
    doc["models"][0]["endpoints"] = doc["endpoints"].pop("models")["text"]
    with pytest.raises(ConfigError, match=re.escape("models[0].endpoints beside the top-level `model`/`endpoints`")):
        parse_config(doc)
    with pytest.raises(ConfigError, match="models: List should have at least 1 item"):
        parse_config({**one_list(old("one-host")), "models": []})
    new = one_list(old("two-models"))
    new["models"][1]["name"] = "vision"
    with pytest.raises(ConfigError, match=re.escape("models[1].name 'vision' is served twice")):
        parse_config(new)
    new = one_list(old("two-models"))
    new["models"][1]["endpoints"]["pd"][0]["id"] = "epd-pd-0"
    with pytest.raises(ConfigError, match=re.escape("duplicate engine id 'epd-pd-0' (in models[0].endpoints.pd")):
        parse_config(new)


async def test_a_reload_from_the_old_shape_to_the_list_keeps_every_lane_and_warns_of_no_restart(
    tmp_path, char_renderer, caplog
):
    """What a re-deploy of a fleet of the release before does to its router: the old file is
    running, the list replaces it, one SIGHUP. Every lane takes its pools from the list and no
    restart-only setting reads as changed (a model's limits compared as its lane reads them)."""
    doc = old("two-models")
    doc["admin"]["token_file"] = doc["engine_auth"]["key_file"] = None  # files of the host, not here
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(doc))
    service = RouterService(parse_config(doc), char_renderer(), config_path=path)
    new = one_list(doc)
    new["models"][1]["endpoints"]["pd"][0]["state"] = "draining"
    path.write_text(yaml.safe_dump(new))
    with caplog.at_level(logging.WARNING, logger="epd_router.service"):
        assert service.reload()
    assert service_warnings(caplog) == []
    assert list(service.lanes) == ["vision", "text"]
    assert service.lanes["text"].state.pools.pd[0].state.value == "draining"
    assert service.state is service.lanes["vision"].state  # the service's own lane: the listed first


def test_a_file_that_does_not_read_as_models_rolls_the_processes_without_failing_the_play():
    broken = old("two-models")
    del broken["endpoints"]["models"]["text"]  # a model without pools: not the router's file either
    view = restart_view(broken)
    assert view == {"unreadable": "models[0] (text) has no pools: add endpoints.models.text"}
    assert view != restart_view(old("two-models")) and restart_view({}) == {}


async def test_a_reload_that_renames_the_listed_first_model_still_applies_its_pools(tmp_path, char_renderer, caplog):
    """The name is read at start (a restart applies it, and says so); the pools of the model a
    request without `model` gets still follow the file, as the plan's endpoints-only writes do."""
    doc = one_list(old("one-host"))
    doc["admin"]["token_file"] = doc["engine_auth"]["key_file"] = None  # files of the host, not here
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(doc))
    service = RouterService(parse_config(doc), char_renderer(), config_path=path)
    doc["models"][0]["name"] = "vision"
    doc["models"][0]["endpoints"]["pd"][0]["state"] = "draining"
    path.write_text(yaml.safe_dump(doc))
    with caplog.at_level(logging.WARNING, logger="epd_router.service"):
        assert service.reload()
    assert [e.state.value for e in service.state.pools.pd] == ["draining", "active"]
    assert list(service.lanes) == ["/models/tiny-qwen3-vl"]  # served under its old name until a restart
    warnings = service_warnings(caplog)
    assert warnings == ["config reload: 'models./models/tiny-qwen3-vl.name' changed; it takes effect only on restart"]

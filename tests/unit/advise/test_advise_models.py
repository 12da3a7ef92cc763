"""The advisor on a fleet of several models (epd_models): a section per model, each model's
figures from its own series (the router's `model` label) and engines, each recommendation
moving that model's engines only; a change that would move another model's engine is refused
naming it (docs/advisor.md "Several models")."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from epd_kit.cli import main
from tests.unit.advise.advise_scrapes import Load, run_advise, write_inventory, write_scrapes

TEXT = {"name": "text", "model": "/models/tiny-text", "text_only": True, "num_pd": 1}
# the first model's VE is the bottleneck (one VE ~82 % busy), its PDs are idle
VISION_LOAD = Load(rate=10, image_share=0.9, ve_service_s=0.091, pd_service_s=0.3, num_ve=1, num_pd=2)
# the text model's one PD is ~87 % busy (7 requests/s of 1 s on 8 slots), no images
TEXT_LOAD = Load(rate=7, image_share=0.0, ve_service_s=0.1, pd_service_s=1.0, num_ve=0, num_pd=1, seed=11)


def advise(tmp_path, hosts, vision: Load, text: Load, **group_vars) -> tuple[dict, str]:
    before, after = write_scrapes(vision, tmp_path / "scrapes", "vision", text=text)
    inventory = write_inventory(
        tmp_path / "inv.json", hosts, epd_models=[TEXT], epd_router_served_model_name="vision", **group_vars
    )
    return run_advise(before, after, vision.seconds, inventory)


def test_each_model_is_advised_on_its_own_series_and_engines(tmp_path):
    doc, text = advise(tmp_path, {"n1": (1, 2)}, VISION_LOAD, TEXT_LOAD)
    vision, plain = doc["models"]["vision"], doc["models"]["text"]
    assert list(doc["models"]) == ["vision", "text"] and doc["requests_without_model"] == 0
    # each model's own requests and engines: none of the other's load is read as its own
    assert vision["requests"] == pytest.approx(10 * VISION_LOAD.seconds, rel=0.15)
    assert plain["requests"] == pytest.approx(7 * TEXT_LOAD.seconds, rel=0.15)
    assert (vision["pools"]["ve"]["engines"], vision["pools"]["pd"]["engines"]) == (1, 2)
    assert (plain["pools"]["ve"]["engines"], plain["pools"]["pd"]["engines"]) == (0, 1)
    assert plain["pools"]["ve"]["rate_per_s"] == 0
    assert vision["bottleneck"] == "ve" and plain["bottleneck"] == "pd"
    assert vision["pools"]["pd"]["busy"] < 0.3 and plain["pools"]["pd"]["busy"] == pytest.approx(0.87, abs=0.08)
    # each moves its own engines: the first model per host, the further one through its entry
    assert vision["recommendation"]["inventory_change"] == ["n1: epd_num_ve 1 -> 2, epd_num_pd 2 -> 2"]
    assert plain["recommendation"]["inventory_change"] == ["epd_models[0] (text): num_ve 0 -> 0, num_pd 1 -> 2"]
    assert vision["recommendation"]["refused"] is None and plain["recommendation"]["refused"] is None
    sections = text.split("=== model ")
    assert text.startswith("2 models: vision, text;") and len(sections) == 3
    assert sections[1].startswith("vision ===") and "n1: epd_num_ve 1 -> 2" in sections[1]
    assert "epd_models" not in sections[1]
    assert sections[2].startswith("text ===") and "epd_models[0] (text): num_ve 0 -> 0, num_pd 1 -> 2" in sections[2]
    assert "the PD pool bounds latency" in sections[2] and "epd_num_ve" not in sections[2]


def test_a_change_that_would_move_another_models_engine_is_refused_naming_it(tmp_path):
    """32 cores: the vision model's PD (0-7) and VE (8-11), the text model's PD at 16-23. A
    second vision PD places the vision model at 0-15 and 16-19, which pushes the text model's
    PD to 24-31: refused, and the report says so instead of proposing it."""
    pd_heavy = Load(rate=24, image_share=0.1, ve_service_s=0.05, pd_service_s=0.3, num_ve=1, num_pd=1)
    quiet_text = Load(rate=1, image_share=0.0, ve_service_s=0.1, pd_service_s=0.2, num_ve=0, num_pd=1, seed=3)
    doc, text = advise(tmp_path, {"n1": (1, 1)}, pd_heavy, quiet_text, epd_core_count=32)
    vision = doc["models"]["vision"]
    assert vision["bottleneck"] == "pd"
    rec = vision["recommendation"]
    assert not rec["changed"]
    assert rec["refused"].startswith("n1: epd_num_ve 1 -> 1, epd_num_pd 1 -> 2 would move model text's engine")
    assert "epd-text-pd-0 from n1 cores 16-23 port 18164 to n1 cores 24-31 port 18164" in rec["refused"]
    assert "not proposed: n1: epd_num_ve 1 -> 1, epd_num_pd 1 -> 2 would move model text's engine" in text


def test_requests_refused_before_their_model_is_known_are_counted_apart(tmp_path):
    clean, _ = advise(tmp_path / "clean", {"n1": (1, 2)}, VISION_LOAD, TEXT_LOAD)
    before, after = write_scrapes(VISION_LOAD, tmp_path / "scrapes", "vision", text=TEXT_LOAD)
    lines = after.read_text().splitlines(keepends=True)
    at = lines.index("# TYPE epd_router_requests_total counter\n") + 1
    lines.insert(at, 'epd_router_requests_total{model="_none",status="404"} 42.0\n')
    after.write_text("".join(lines))
    inventory = write_inventory(
        tmp_path / "inv.json", {"n1": (1, 2)}, epd_models=[TEXT], epd_router_served_model_name="vision"
    )
    args = ["advise", "--before", str(before), "--after", str(after), "--window", "120", "--inventory", str(inventory)]
    out = CliRunner().invoke(main, [*args, "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["requests_without_model"] == 42
    for model in ("vision", "text"):  # no model's figures take them
        assert doc["models"][model]["requests"] == clean["models"][model]["requests"]
    assert "42 requests were refused before their model was known" in CliRunner().invoke(main, args).output


def test_scrapes_without_the_model_label_are_refused_for_several_models(tmp_path):
    """A router from before the label: one model's load cannot be told from another's."""
    old = '# TYPE epd_router_requests counter\nepd_router_requests_total{status="200"} {n}\n'
    before, after = tmp_path / "b.prom", tmp_path / "a.prom"
    before.write_text(old.replace("{n}", "1"))
    after.write_text(old.replace("{n}", "500"))
    inventory = write_inventory(tmp_path / "inv.json", {"n1": (1, 2)}, epd_models=[TEXT])
    args = ["advise", "--before", str(before), "--after", str(after), "--window", "120", "--inventory", str(inventory)]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 2 and "carry no `model` label" in out.output


def test_each_models_preprocess_cache_is_its_own(tmp_path):
    """The router's preprocess cache counters carry the model (each model's renderer has its
    own cache): each section shows its own model's hit ratio, the text model's none."""
    vision = Load(
        rate=10, image_share=0.9, ve_service_s=0.05, pd_service_s=0.3, num_ve=1, num_pd=2, cache_hit_share=0.25
    )
    second = Load(
        rate=5, image_share=1.0, ve_service_s=0.05, pd_service_s=0.3, num_ve=1, num_pd=1, seed=5, cache_hit_share=0.75
    )
    before, after = write_scrapes(vision, tmp_path / "scrapes", "vision", second=second, text=TEXT_LOAD)
    further = [{"name": "second", "model": "/models/tiny-second", "num_ve": 1, "num_pd": 1}, TEXT]
    inventory = write_inventory(
        tmp_path / "inv.json", {"n1": (1, 2)}, epd_models=further, epd_router_served_model_name="vision"
    )
    _, text = run_advise(before, after, vision.seconds, inventory)
    sections = dict(section.split(" ===", 1) for section in text.split("=== model ")[1:])
    assert "router preprocess cache hit 25%" in sections["vision"]
    assert "router preprocess cache hit 75%" in sections["second"]
    assert "router preprocess cache hit -" in sections["text"]

"""bench/advisor.py's pieces that run without a stack: the inventory it advises on, the picture."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from bench.advisor import inventory, svg
from epd_kit.advise.layout import Advisor, inventory_from_json


def test_the_bench_inventory_is_the_sandbox_one_host_and_plans():
    advisor = Advisor(inventory_from_json(inventory(1, 2), "bench"))
    assert advisor.current.counts == {"n1": (1, 2)}
    assert [line.split()[4] for line in advisor.plan_lines(advisor.current)[1:4]] == ["0-7", "8-15", "16-19"]


def test_the_picture_is_well_formed_svg(tmp_path):
    fig = {"stages_s": {"preprocess": 0.01, "encode": 0.19, "pd_first_token": 0.05}, "busy": {"ve": 0.66, "pd": 0.03}}
    after = {"stages_s": {"preprocess": 0.01, "encode": 0.11, "pd_first_token": 0.05}, "busy": {"ve": 0.4, "pd": 0.03}}
    path = tmp_path / "a.svg"
    svg(fig, after, ("1E2PD", "2E2PD"), path)
    root = ET.parse(path).getroot()
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "VE 1E2PD: 66%" in texts and "VE 2E2PD: 40%" in texts

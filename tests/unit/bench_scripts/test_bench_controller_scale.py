"""bench/controller_scale.py's pieces that need no ansible-playbook: the fleet it generates plans as
it says (the timings themselves are the bench's, docs/benchmarks.md "Controller at fleet scale")."""

from __future__ import annotations

import yaml

from bench.common import REPO
from bench.controller_scale import Timing, table, write_inventory
from epd_kit.plan import check_inventory


def test_the_generated_fleet_plans_one_ve_and_six_pd_or_eight_pd_per_host(tmp_path):
    directory = write_inventory(tmp_path / "inventory", 16, REPO)
    hosts = yaml.safe_load((directory / "hosts.yml").read_text())["all"]
    settings = yaml.safe_load((directory / "group_vars" / "all" / "epd.yml").read_text())
    engines = hosts["children"]["epd_engines"]["hosts"]
    hostvars = {name: {**settings, **variables} for name, variables in engines.items()}
    groups = {"epd_engines": list(engines), "epd_router": list(hosts["children"]["epd_router"]["hosts"])}
    checked = check_inventory(hostvars, groups)
    assert checked["problems"] == []
    roles = [[engine["role"] for engine in checked["plan"][name]["engines"]] for name in engines]
    assert sum(r.count("ve") for r in roles) == 4 and sum(r.count("pd") for r in roles) == 4 * 6 + 12 * 8
    assert all(variables["ansible_host"].startswith("10.213.") for variables in engines.values())


def test_the_table_puts_each_size_in_its_column_and_names_a_run_that_did_not_finish():
    timings = [Timing("after", "render", 16, 3.0, 5.0), Timing("before", "render", 16, None, None)]
    assert table(timings, [16, 64])[2:] == [
        "| render | after | 3.0 s (5.0 s CPU) |  |",
        "| render | before | did not finish |  |",
    ]

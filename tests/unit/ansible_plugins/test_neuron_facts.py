"""plugins/modules/epd_neuron_facts.py: faulted Neuron devices from a (fake) driver sysfs tree."""

import json
import sys
from pathlib import Path

import pytest

from epd_kit import plan
from tests import repo_modules
from tests.ansible import helpers
from tests.budget import scaled

REPO = Path(__file__).resolve().parents[3]
scan = repo_modules.module("epd_neuron_facts").scan_neuron_devices


def fake_tree(root, devices=16, cores=4, fail=None, req=None):
    """The driver's layout: neuron<d>/neuron_core<c>/stats/other_info/reset_{req,fail}_count/total."""
    fail = fail or {}
    for d in range(devices):
        for c in range(cores):
            info = root / f"neuron{d}" / f"neuron_core{c}" / "stats" / "other_info"
            for counter, value in (
                ("reset_fail_count", fail.get((d, c), 0)),
                ("reset_req_count", (req or {}).get((d, c), 1)),
            ):
                (info / counter).mkdir(parents=True, exist_ok=True)
                (info / counter / "total").write_text(f"{value}\n")
    return root


def test_absent_tree_means_nothing_faulted(tmp_path):
    result = scan(str(tmp_path / "missing"))
    assert result["sysfs_present"] is False
    assert (result["device_count"], result["faulted_devices"], result["faulted_cores"]) == (0, [], [])


def test_healthy_trn2_has_16_devices_64_cores_and_no_fault(tmp_path):
    result = scan(str(fake_tree(tmp_path / "nd")))
    assert (result["device_count"], result["core_count"], result["faulted_cores"]) == (16, 64, [])


def test_faulted_device_excludes_every_core_of_it(tmp_path):
    # the tutorial's faulted device: nonzero fail on all its cores
    root = fake_tree(tmp_path / "nd", fail={(5, c): 2 for c in range(4)} | {(12, 3): 1})
    result = scan(str(root))
    assert result["faulted_devices"] == [5, 12]
    assert result["faulted_cores"] == [20, 21, 22, 23, 48, 49, 50, 51]
    assert result["reset_fail_counts"]["nd5"] == {"nc0": 2, "nc1": 2, "nc2": 2, "nc3": 2}
    assert result["reset_fail_counts"]["nd12"]["nc3"] == 1 and "nd0" not in result["reset_fail_counts"]


def test_reset_requests_alone_are_not_a_fault(tmp_path):
    result = scan(str(fake_tree(tmp_path / "nd", req={(3, 0): 7})))
    assert result["faulted_devices"] == []


def test_cores_per_device_sets_the_numbering(tmp_path):
    result = scan(str(fake_tree(tmp_path / "nd", devices=4, cores=8, fail={(2, 7): 1})), cores_per_device=8)
    assert result["faulted_cores"] == list(range(16, 24)) and result["core_count"] == 32
    with pytest.raises(ValueError, match="cores_per_device must be a positive integer"):
        scan(str(tmp_path), cores_per_device=0)


def test_unparsable_and_missing_counters_are_reported_not_faulted(tmp_path):
    root = fake_tree(tmp_path / "nd", devices=2)
    counter = root / "neuron1" / "neuron_core2" / "stats" / "other_info" / "reset_fail_count" / "total"
    counter.write_text("n/a\n")
    (root / "neuron0" / "neuron_core0" / "stats" / "other_info" / "reset_fail_count" / "total").unlink()
    (root / "not_a_device").mkdir()
    result = scan(str(root))
    assert result["unreadable"] == [str(counter)]
    assert result["faulted_devices"] == [] and result["device_count"] == 2


def test_scan_result_feeds_the_planner(tmp_path):
    result = scan(str(fake_tree(tmp_path / "nd", fail={(1, 0): 1})))
    hostvars = {
        "n1": {"epd_model": "/models/m", "epd_num_ve": 1, "epd_num_pd": 1, "ansible_facts": {"epd_neuron": result}}
    }
    fleet_plan = plan.plan_from_hostvars(hostvars, ["n1"])
    cores = {e["instance"]: e["cores"] for e in fleet_plan["n1"]["engines"]}
    assert cores == {"pd-0": list(range(8, 16)), "ve-0": [0, 1, 2, 3]}
    assert fleet_plan["n1"]["faulted_cores"] == [4, 5, 6, 7]


@pytest.mark.ansible
def test_module_runs_under_ansible_in_check_mode(tmp_path):
    root = fake_tree(tmp_path / "nd", devices=2, fail={(1, 2): 4})
    result = helpers.run(
        [
            str(helpers.BIN / "ansible"),
            "localhost",
            "-i",
            "localhost,",
            "-c",
            "local",
            "--check",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            "-m",
            "epd.kit.epd_neuron_facts",
            "-a",
            f"root={root}",
        ],
        timeout=scaled(120),
        ANSIBLE_STDOUT_CALLBACK="minimal",
        ANSIBLE_CALLBACK_RESULT_FORMAT="json",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    head, _, body = result.stdout.partition(" => ")
    assert head.strip().endswith("localhost | SUCCESS"), result.stdout
    task = json.loads(body)
    assert task["changed"] is False
    assert task["faulted_devices"] == [1] and task["faulted_cores"] == [4, 5, 6, 7]
    assert task["ansible_facts"]["epd_neuron"]["device_count"] == 2
    assert "faulted state" in result.stdout + result.stderr

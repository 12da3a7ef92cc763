"""render.yml renders the fleet in shares, one task each on the controller (render_workers, default
2): any number of shares writes the same files, and a host whose files cannot be rendered fails
the run with its name, also when another host of its share renders it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.ansible.helpers import REPO, playbook

pytestmark = pytest.mark.ansible

MULTI_NODE = REPO / "inventory/examples/multi-node"


def tree(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("workers", ["1", "3"])
def test_any_number_of_shares_writes_the_same_files(workers, rendered, tmp_path):
    out = tmp_path / "out"
    result = playbook("-i", str(MULTI_NODE), "playbooks/render.yml", "-e", f"render_dir={out}",
                      "-e", f"render_workers={workers}")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    expected = tree(rendered(MULTI_NODE))
    assert len({name.split("/")[0] for name in expected}) > 1, "the example should have several hosts"
    assert tree(out) == expected


def test_a_host_that_cannot_be_rendered_fails_the_run_with_its_name(tmp_path):
    """n2's templates read an undefined variable; n1 renders the one share (render_workers=1)."""
    engines = {
        "n1": {"epd_num_ve": 1, "epd_num_pd": 1, "epd_bind_address": "10.213.0.11"},
        "n2": {"epd_num_pd": 1, "epd_bind_address": "10.213.0.12", "ansible_managed": "{{ undefined_thing }}"},
    }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "vars": {
                        "epd_model": "/models/m",
                        "epd_engine_backend": "sim",
                        "epd_client_networks": ["10.213.0.0/16"],
                    },
                    "children": {"epd_engines": {"hosts": engines}, "epd_router": {"hosts": {"n1": {}}}},
                }
            }
        )
    )
    out = tmp_path / "out"
    result = playbook("-i", str(inventory), "playbooks/render.yml", "-e", f"render_dir={out}", "-e", "render_workers=1")
    assert result.returncode != 0
    assert "rendering n2: 'undefined_thing' is undefined" in result.stdout, result.stdout[-3000:]
    assert (out / "n1/etc/systemd/system/epd-engine@.service").is_file()  # rendered before n2
    assert not (out / "n2/etc/systemd/system/epd-engine@.service").exists()


@pytest.mark.parametrize("workers", ["two", "0", "1.5"])
def test_a_share_count_that_is_not_a_count_is_refused_naming_it(workers, tmp_path):
    """`| int` reads a word as 0: the count is checked as written, and the message names
    render_workers, not render_dir, and renders nothing."""
    out = tmp_path / "out"
    result = playbook("-i", str(MULTI_NODE), "playbooks/render.yml", "-e", f"render_dir={out}",
                      "-e", f"render_workers={workers}")  # fmt: skip
    assert result.returncode != 0
    assert f"render_workers must be a whole number > 0 (how many shares render the fleet), got {workers}" in (
        result.stdout
    )
    assert "pass the output directory" not in result.stdout
    assert not out.exists()

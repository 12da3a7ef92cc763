"""The vllm:* names the kit reads and the sim exports are real vLLM's (docs/observability.md
"Engine metrics the kit reads"): held to the families real VE and PD engines exported,
recorded per vLLM version by tests/real_engines/test_metrics.py."""

from __future__ import annotations

import re

from epd_kit.sim.metrics import SimMetrics
from tests.metric_names import REPO, ROLES, family, kit_reads, recorded
from tests.vllm_dist import NO_RELEASE, VLLM_VERSIONS

DOCS = REPO / "docs" / "observability.md"


def sim_families() -> set[str]:
    text = SimMetrics("m", "e").render().decode()
    return {family(line.split()[2]) for line in text.splitlines() if line.startswith("# TYPE ")}


def docs_table() -> set[str]:
    """The first column of the "Engine metrics the kit reads" table."""
    section = DOCS.read_text().split("## Engine metrics the kit reads", 1)[1].split("\n## ", 1)[0]
    table = section.split("| family |", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"^\| `(vllm:[a-z_]+)` \|", table, re.M))


def test_every_vllm_version_of_the_kit_has_a_recorded_list():
    # a vLLM no release names (NO_RELEASE) runs no kit fleet, so no metrics the kit reads from it
    assert sorted(recorded()) == sorted(set(VLLM_VERSIONS) - set(NO_RELEASE))
    for version, roles in recorded().items():
        for role in ROLES:
            assert "vllm:num_requests_running" in roles[role], (version, role)


def test_the_sims_vllm_families_are_real_vllms():
    """The sim exports no vllm:* family a real VE or PD of either version lacks; what it counts
    beyond vLLM is epd_sim:*."""
    sim = sim_families()
    assert sim, "the sim exports nothing"
    for version, roles in recorded().items():
        for role in ROLES:
            extra = {name for name in sim if name.startswith("vllm:")} - roles[role]
            assert not extra, f"the sim exports {sorted(extra)}, which a real vLLM {version} {role.upper()} does not"
    assert {name for name in sim if not name.startswith("vllm:")} <= {
        name for name in sim if name.startswith("epd_sim:")
    }


def test_every_engine_metric_the_kit_reads_is_real_and_the_sim_has_it():
    reads = kit_reads()
    assert {"vllm:num_requests_waiting", "vllm:request_queue_time_seconds"} <= set(reads)  # the parser finds them
    sim = sim_families()
    for name, roles in reads.items():
        assert name in sim, f"{name} is read by the kit but the sim does not export it"
        for version, families in recorded().items():
            for role in roles:
                assert name in families[role], f"{name} is read from the {role.upper()} but vLLM {version} lacks it"


def test_the_docs_table_lists_exactly_what_the_kit_reads():
    assert docs_table() == set(kit_reads())


def test_the_parser_sees_roles_and_suffixes():
    out: dict[str, set[str]] = {}
    from tests.metric_names import _reads

    _reads('sum(rate(vllm:a_total{role="pd"}[5m])) / vllm:b_bucket{le="1"} + vllm:c', "x", out)
    assert out == {"vllm:a": {"pd"}, "vllm:b": {"ve", "pd"}, "vllm:c": {"ve", "pd"}}

"""The systemd expander the tests use, and the engine env template's quoting.

(The engine command model itself, unit variables and ExecStart: tests/unit/plan/test_command.py.)"""

from __future__ import annotations

import pytest

from tests.ansible.helpers import REPO
from tests.ansible.systemd_expand import expand_command, parse_env_file, parse_unit, service_command

pytestmark = pytest.mark.ansible


def test_expander_braced_is_one_word_unbraced_splits():
    env = {"J": '{"a": 1, "b": 2}', "R": "--x  --y", "E": ""}
    assert expand_command("/bin/e ${J} $R $E ${E} a${J}b $$R %i", "u@inst.service", env) == [
        "/bin/e",
        '{"a": 1, "b": 2}',
        "--x",
        "--y",
        "",
        'a{"a": 1, "b": 2}b',
        "$R",
        "inst",
    ]


def test_env_file_quoting():
    env = parse_env_file('# c\nA=\'{"x": 1}\'\nB="q \\"z\\" \\$HOME"\nC= plain value  \n; other\nD=\'\'\n')
    assert env == {"A": '{"x": 1}', "B": 'q "z" $HOME', "C": "plain value", "D": ""}


def test_unit_parser_joins_continuations_and_orders_environment():
    unit = (
        "[Service]\nEnvironment=A=1 B=2\nEnvironmentFile=/e/%i.env\n"
        "ExecStart=/bin/x \\\n  # a comment\n  ${A} \\\n  $B\n"
    )
    argv, env = service_command(unit, "s@k.service", {"/e/k.env": "A=from-file\n"})
    assert argv == ["/bin/x", "from-file", "2"] and env == {"A": "from-file", "B": "2"}
    assert parse_unit(unit).values("Service", "EnvironmentFile") == ["/e/%i.env"]


def test_env_template_round_trips_awkward_values(tmp_path):
    """templates/epd-engine.env.j2 quoting survives systemd's env-file parser for any value."""
    import jinja2

    values = {"A": '{"k": "v"}', "B": 'it\'s $HOME \\ `x` "q"', "C": "", "D": "a b"}
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=False).from_string(
        (REPO / "templates/epd-engine.env.j2").read_text()
    )
    text = template.render(
        ansible_managed="Ansible managed",
        engine={"engine_id": "e", "role": "pd", "tp": 8, "dp": 1, "cores": [0], "instance": "pd-0"},
        epd_engine_unit={"env_file": values},
    )
    assert parse_env_file(text) == values

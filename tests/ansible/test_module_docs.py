"""The kit's Ansible modules document themselves as ansible-doc reads them: every module's
DOCUMENTATION, EXAMPLES and RETURN parse (a `: ` in a plain YAML line once broke three of them
without any other check noticing), and the documented options are exactly the argument spec's."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from tests.ansible.helpers import BIN, REPO, run

pytestmark = pytest.mark.ansible

MODULES = sorted((REPO / "plugins/modules").glob("*.py"))


def argument_spec_keys(source: Path) -> set[str]:
    """The top-level option names of the AnsibleModule(argument_spec={...}) literal in the file."""
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "AnsibleModule":
            for keyword in node.keywords:
                if keyword.arg == "argument_spec" and isinstance(keyword.value, ast.Dict):
                    return {ast.literal_eval(key) for key in keyword.value.keys}
    raise AssertionError(f"{source.name}: no AnsibleModule(argument_spec={{...}}) literal")


def test_every_module_documents_exactly_its_options():
    names = [f"epd.kit.{path.stem}" for path in MODULES]
    result = run([str(BIN / "ansible-doc"), "--json", *names])
    assert result.returncode == 0, result.stderr[-3000:]
    docs = json.loads(result.stdout)
    assert sorted(docs) == sorted(names)
    for path in MODULES:
        entry = docs[f"epd.kit.{path.stem}"]
        assert entry["doc"]["short_description"], path.name
        assert entry["examples"], f"{path.name} has no EXAMPLES"
        assert entry["return"] is not None, f"{path.name} has no RETURN"
        documented = set(entry["doc"].get("options") or {})
        assert documented == argument_spec_keys(path), path.name

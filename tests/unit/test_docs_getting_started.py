"""docs/getting-started.md names only what the tree has: every playbook, script, example
inventory and docs page it points to exists, every `epd_*` variable is declared
(plan/variables.py), every flag of ansible-playbook and every tag it uses exist, the pip
extras it installs are the distribution's, its YAML and Python parse, every "Heading" it cites
is a heading of that page, and it stays a short page. README points to it first."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from epd_kit.plan.variables import VARIABLES

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "getting-started.md"
TEXT = PAGE.read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", TEXT, re.S)
COMMANDS = "\n".join(body for lang, body in BLOCKS if lang == "bash")
MAX_LINES = 150
OWN_INVENTORY = "inventory/my-trn2"  # the reader's copy (step 3)


def test_it_is_a_short_page_that_readme_points_to_first():
    assert len(TEXT.splitlines()) <= MAX_LINES
    readme = (REPO / "README.md").read_text()
    docs_links = re.findall(r"\]\((docs/[\w./-]+)\)", readme)
    assert docs_links[0] == "docs/getting-started.md", docs_links[:3]
    # README's two opening commands stay where they are
    assert readme.index("scripts/demo.sh          #") < readme.index("scripts/test.sh          #")


def test_every_playbook_script_and_inventory_it_names_exists():
    playbooks = set(re.findall(r"playbooks/[\w-]+\.yml", TEXT))
    assert {"playbooks/plan.yml", "playbooks/provision.yml", "playbooks/deploy.yml"} <= playbooks
    paths = playbooks | set(re.findall(r"scripts/[\w.-]+", TEXT)) | set(re.findall(r"inventory/[\w/-]+", TEXT))
    paths = {path.rstrip("/") for path in paths if not path.startswith(OWN_INVENTORY)}
    missing = sorted(path for path in paths if not (REPO / path).exists())
    assert not missing, f"docs/getting-started.md names what the tree lacks: {missing}"
    # the copied example has the files the page tells the reader to edit
    example = REPO / "inventory/examples/trn2-2e7pd"
    for edited in re.findall(rf"`{OWN_INVENTORY}/([\w/.-]+)`", TEXT):
        assert (example / edited).is_file(), f"inventory/examples/trn2-2e7pd has no {edited}"


def test_every_variable_it_names_is_declared():
    named = set(re.findall(r"\bepd_[a-z0-9_]+\b", TEXT))
    assert {"epd_model", "epd_engine_venv"} <= named
    assert not named - set(VARIABLES), f"not declared in plan/variables.py: {sorted(named - set(VARIABLES))}"


def test_its_yaml_parses_into_declared_variables_and_its_python_compiles():
    for lang, body in BLOCKS:
        if lang == "yaml":
            values = yaml.safe_load(body)
            assert isinstance(values, dict) and values
            kit = {key for key in values if key.startswith("epd_")}
            assert kit <= set(VARIABLES), kit - set(VARIABLES)
            # the sample's value is the example's (nothing else to edit by mistake)
            example = yaml.safe_load((REPO / "inventory/examples/trn2-2e7pd/group_vars/all/epd.yml").read_text())
            assert all(example[key] == values[key] for key in kit if key in example)
        elif lang == "python":
            ast.parse(body)


def test_every_ansible_playbook_flag_and_tag_exists():
    helped = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "--help"], capture_output=True, text=True, check=True
    ).stdout
    lines = [line for line in COMMANDS.splitlines() if "ansible-playbook" in line]
    assert lines
    flags = {flag for line in lines for flag in re.findall(r"\s(--?[a-z][\w-]*)", line.split("#", 1)[0])}
    assert flags >= {"-i", "--check", "--tags"}
    assert all(re.search(rf"(^|[\s,]){re.escape(flag)}\b", helped, re.M) for flag in flags), flags
    for line in lines:
        for tag in re.findall(r"--tags (\S+)", line):
            book = (REPO / re.search(r"playbooks/[\w-]+\.yml", line)[0]).read_text()
            assert re.search(rf"tags: \[[^\]]*\b{tag}\b", book), f"{tag} is not a tag of that playbook"


def test_the_install_uses_the_distributions_extras():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for wanted in re.findall(r"pip install -e '\.\[([\w,]+)\]'", COMMANDS):
        assert set(wanted.split(",")) <= set(extras)
    assert "ansible-core" in " ".join(extras["test"])  # "the kit and ansible-core"


def test_the_request_and_defaults_it_states_are_the_kits():
    assert f"127.0.0.1:{VARIABLES['epd_router_port'].default}" in TEXT
    assert f"`epd_compilation_timeout_s`, {VARIABLES['epd_compilation_timeout_s'].default} s" in TEXT
    model = yaml.safe_load((REPO / "inventory/examples/trn2-2e7pd/group_vars/all/epd.yml").read_text())["epd_model"]
    assert TEXT.count(f'"{model}"') >= 2  # the curl body and the openai call name the served model


def test_every_page_and_heading_it_cites_exists():
    cited = re.findall(r'(docs/[\w-]+\.md)(?: "([^"]+)")?', TEXT)
    assert cited
    for page, heading in cited:
        assert (REPO / page).is_file(), page
        if heading:
            headings = re.findall(r"^#+ (.+)$", (REPO / page).read_text(), re.M)
            assert any(h == heading or h.startswith(heading + " (") for h in headings), f'{page} has no "{heading}"'

"""epd.kit.epd_files and epd.kit.epd_host_state, the modules that write and read a role's files in
one module run each, through real ansible-playbook on this machine: check mode writes nothing, a
second run changes nothing, a change names exactly the paths it touched, and a bad entry fails
with what was wrong."""

from __future__ import annotations

import grp
import os
import pwd
import stat

import pytest

from tests.ansible.helpers import local_play, local_plays

pytestmark = pytest.mark.ansible

OWNER = pwd.getpwuid(os.getuid()).pw_name
GROUP = grp.getgrgid(os.getgid()).gr_name


def _entry(path, mode, content=None):
    entry = {"path": str(path), "owner": OWNER, "group": GROUP, "mode": mode}
    if content is not None:
        entry["content"] = content
    return entry


@pytest.fixture(scope="module")
def played(tmp_path_factory):
    """The four cases' tasks in one ansible-playbook run (helpers.local_plays; a run is ~2-4 CPU-s
    however few its tasks): case -> (what its test checks against, its registered results). Each
    case prepares its own directory first; each test below checks its own case."""
    prepared = {case.__name__: case(tmp_path_factory.mktemp(case.__name__)) for case in CASES}
    results = local_plays(tmp_path_factory.mktemp("played"), {c: (t, names) for c, (t, names, _) in prepared.items()})
    return {case: (context, results[case]) for case, (_, _, context) in prepared.items()}


def written_once(tmp_path):
    root = tmp_path / "etc"
    unit, env, empty = root / "units/a.service", root / "a.env", root / "empty"
    first = [
        _entry(root, "0750"),
        _entry(root / "units", "0755"),
        _entry(unit, "0644", "[Unit]\nDescription=a\n"),
        _entry(env, "0640", "X='1'\n"),
    ]
    changed = [*first[:2], _entry(unit, "0644", "[Unit]\nDescription=b\n"), _entry(env, "0600", "X='1'\n")]

    def write(name, files, **task):
        return {"name": name, "epd.kit.epd_files": {"files": files}, "register": name, **task}

    def look(name, path):
        return {"name": name, "ansible.builtin.stat": {"path": str(path)}, "register": name}

    tasks = [
        write("checked", first, check_mode=True, diff=True),
        look("after_check", root),
        write("written", first),
        look("inode", unit),
        write("again", first),
        write("changed", changed, diff=True),
        write("no_parent", [_entry(tmp_path / "missing/x", "0644", "")], ignore_errors=True),
        write("bad_mode", [_entry(tmp_path / "y", "644x", "")], ignore_errors=True),
        write("dir_as_file", [_entry(root, "0644", "")], ignore_errors=True),
        write("file_as_dir", [_entry(env, "0755")], ignore_errors=True),
        write("empty", [_entry(empty, "0600", "")]),
    ]
    return tasks, [task["register"] for task in tasks if task["register"] != "empty"], (root, unit, env, empty, first)


def test_files_are_written_once_and_each_change_is_named(played):
    (root, unit, env, empty, first), r = played["written_once"]

    every_path = [e["path"] for e in first]
    assert r["checked"]["changed_paths"] == every_path  # check mode reports all four...
    assert not r["after_check"]["stat"]["exists"]  # ...and writes none
    assert [d["after_header"] for d in r["checked"]["diff"]] == every_path
    assert r["written"]["changed_paths"] == every_path
    assert r["again"] == {**r["again"], "changed": False, "changed_paths": []}

    assert r["changed"]["changed_paths"] == [str(unit), str(env)]  # content, then mode only
    unit_diff, env_diff = r["changed"]["diff"]
    assert (unit_diff["before"], unit_diff["after"]) == ("[Unit]\nDescription=a\n", "[Unit]\nDescription=b\n")
    assert (env_diff["before"]["mode"], env_diff["after"]["mode"]) == ("0640", "0600")
    assert unit.read_text() == "[Unit]\nDescription=b\n"
    assert os.stat(unit).st_ino != r["inode"]["stat"]["inode"]  # replaced by a rename, not rewritten in place
    assert stat.S_IMODE(os.stat(env).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o750
    assert empty.read_text() == "" and stat.S_IMODE(os.stat(empty).st_mode) == 0o600  # empty content is a file
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # no temporary file left

    assert r["no_parent"]["failed"] and "does not exist" in r["no_parent"]["msg"]
    assert r["bad_mode"]["failed"] and "'644x' is not an octal mode" in r["bad_mode"]["msg"]
    assert r["dir_as_file"]["failed"] and "is a directory, not a file" in r["dir_as_file"]["msg"]
    assert r["file_as_dir"]["failed"] and "exists and is not a directory" in r["file_as_dir"]["msg"]


def validated(tmp_path):
    target, log = tmp_path / "rules", tmp_path / "validated"
    checker = f"sh -c 'cat %s >> {log}; grep -q ^ok %s'"
    good, bad = _entry(target, "0644", "ok 1\n"), _entry(target, "0644", "no 2\n")

    def write(name, entry, **task):
        return {
            "name": name,
            "epd.kit.epd_files": {"files": [{**entry, "validate": checker}]},
            "register": name,
            **task,
        }

    tasks = [
        write("first", good),
        write("again", good),
        write("refused", bad, ignore_errors=True),
        {
            "name": "no_placeholder",
            "epd.kit.epd_files": {"files": [{**good, "validate": "true"}]},
            "register": "no_placeholder",
            "ignore_errors": True,
        },
    ]
    return tasks, [task["register"] for task in tasks], (tmp_path, target, log)


def test_files_validate_checks_new_content_before_it_replaces_the_file(played):
    """validate (as template's) runs on the written temporary file, only when the content differs;
    a refusal keeps the old file and names the command's output."""
    (tmp_path, target, log), r = played["validated"]

    assert r["first"]["changed_paths"] == [str(target)]
    assert not r["again"]["changed"]
    assert log.read_text() == "ok 1\nno 2\n"  # checked when new and when changed, not when equal
    assert r["refused"]["failed"] and "failed validation" in r["refused"]["msg"]
    assert target.read_text() == "ok 1\n"  # the refused content never replaced it
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".rules")]  # no temporary file left
    assert r["no_placeholder"]["failed"] and "%s" in r["no_placeholder"]["msg"]


def host_state_read(tmp_path):
    (tmp_path / "b.env").write_text("B=1\n")
    (tmp_path / "a.env").write_text("A='x y'\n")
    (tmp_path / "a.pending").write_text("")
    (tmp_path / ".hidden.env").write_text("")  # an epd_files temporary file is not an engine
    read = {
        "name": "Read",
        "epd.kit.epd_host_state": {
            "files": [str(tmp_path / "a.env"), str(tmp_path / "gone.env")],
            "globs": {"env": f"{tmp_path}/*.env", "pending": f"{tmp_path}/*.pending", "none": "/nonexistent/*"},
            "groups": [GROUP, "epd-no-such-group"],
            "owners": [str(tmp_path / "a.env"), str(tmp_path / "gone.env")],
            "users": [OWNER, "epd-no-such-user"],
        },
        "register": "state",
        "check_mode": True,
    }
    return [read], ["state"], tmp_path


def test_host_state_reads_files_globs_and_unit_states_in_one_run(played):
    """epd.kit.epd_host_state, the read side: missing files read as null, globs come back sorted,
    groups and owners through NSS, and it runs in check mode (the reads a --check deploy decides on)."""
    tmp_path, r = played["host_state_read"]
    state = r["state"]
    assert state["changed"] is False
    assert state["files"] == {str(tmp_path / "a.env"): "A='x y'\n", str(tmp_path / "gone.env"): None}
    assert state["globs"] == {
        "env": [str(tmp_path / "a.env"), str(tmp_path / "b.env")],
        "pending": [str(tmp_path / "a.pending")],
        "none": [],
    }
    assert state["groups"] == {GROUP: True, "epd-no-such-group": False}
    assert state["owners"] == {str(tmp_path / "a.env"): OWNER, str(tmp_path / "gone.env"): None}
    account = pwd.getpwnam(OWNER)
    assert state["users"] == {
        OWNER: {
            "group": grp.getgrgid(account.pw_gid).gr_name,
            "groups": sorted(
                {grp.getgrgid(account.pw_gid).gr_name, *(g.gr_name for g in grp.getgrall() if OWNER in g.gr_mem)}
            ),
            "home": account.pw_dir,
            "shell": account.pw_shell,
        },
        "epd-no-such-user": None,
    }
    # unit states and patterns are read on the test hosts (tests/e2e), which run systemd
    assert state["units"] == {} and state["unit_patterns"] == {}
    assert state["unit_changes"] == {"enable": [], "start": []}  # none asked (test_units_module.py asks)
    assert state["listeners"] == {"conflicts": [], "own": []}  # no port asked: none probed


def snapshot(tmp_path):
    """Every path under tmp_path with its mode and content, but a local play's own files."""
    return sorted(
        (str(p), p.stat().st_mode, p.read_text() if p.is_file() else None)
        for p in tmp_path.rglob("*")
        if p.name not in ("registered.json", "play.yml")
    )


def file_changes(tmp_path):
    root = tmp_path / "etc"
    root.mkdir(mode=0o750)
    os.chmod(root, 0o750)
    (root / "same.env").write_text("X=1\n")
    os.chmod(root / "same.env", 0o640)
    (root / "other.env").write_text("X=1\n")
    os.chmod(root / "other.env", 0o640)
    (root / "mode.env").write_text("X=1\n")
    os.chmod(root / "mode.env", 0o644)
    entries = [
        _entry(root, "0750"),
        _entry(root / "same.env", "0640", "X=1\n"),
        _entry(root / "other.env", "0640", "X=2\n"),
        _entry(root / "mode.env", "0640", "X=1\n"),
        _entry(root / "new", "0755"),
        _entry(root / "new/unit.service", "0644", "[Unit]\n"),
    ]
    stranger = {**_entry(root / "same.env", "0640", "X=1\n"), "owner": "epd-no-such-user"}
    orphan = _entry(tmp_path / "missing/x.env", "0640", "")

    reads = [
        read_changes("read", entries),
        read_changes("read_checked", entries, check_mode=True),
        read_changes("unjudged", [stranger, orphan]),
    ]
    before = snapshot(tmp_path)
    return reads, ["read", "read_checked", "unjudged"], (tmp_path, root, entries, stranger, orphan, before)


def read_changes(name, files, **task):
    return {"name": name, "epd.kit.epd_host_state": {"file_changes": files}, "register": name, **task}


def test_host_state_names_the_paths_epd_files_would_change_and_writes_nothing(played):
    """epd.kit.epd_host_state's file_changes, the read a role skips its epd_files write on: the
    paths epd_files then changes, in check mode or not, nothing written by the read, and none
    once written; an entry the write would fail on (its directory missing, an owner the host does
    not know yet) counts as a change instead of failing the read."""
    (tmp_path, root, entries, stranger, orphan, before), r = played["file_changes"]
    assert snapshot(tmp_path) == before  # wrote nothing
    expected = [str(root / "other.env"), str(root / "mode.env"), str(root / "new"), str(root / "new/unit.service")]
    assert r["read"]["changed"] is False
    assert r["read"]["file_changes"] == expected == r["read_checked"]["file_changes"]
    assert r["unjudged"]["file_changes"] == [stranger["path"], orphan["path"]] and not r["unjudged"].get("failed")

    write = {"name": "write", "epd.kit.epd_files": {"files": entries}, "register": "write"}
    r = local_play(tmp_path, [write, read_changes("again", entries)], ["write", "again"])
    assert r["write"]["changed_paths"] == expected  # what the write then changed: the same paths
    assert r["again"]["file_changes"] == []


CASES = [written_once, validated, host_state_read, file_changes]

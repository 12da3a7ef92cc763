"""A small, faithful model of how systemd turns a unit + EnvironmentFile into argv/environ.

Only what our units use, done the way systemd does it (systemd.unit(5) "Specifiers",
systemd.service(5) "Command lines", systemd.exec(5) "EnvironmentFile="):
- unit files: `#`/`;` comment lines, a trailing backslash joins the next line (replaced by a
  space), comment lines inside a continuation are skipped;
- specifiers: %i (instance, unescaped), %I, %n, %N, %p, %%; an unknown specifier is an error;
- words: whitespace-separated, double/single quotes group, C escapes inside double quotes;
- `${VAR}` anywhere in a word: the value, still one word; `$VAR` as a whole word: the value
  split on whitespace (zero or more words); `$$`: a literal `$`; unset = empty;
- env files: KEY=VALUE per line, `#`/`;` comments, unquoted values trimmed with backslash
  escapes, '...' literal, "..." with backslash escapes of `"\\`$` and line continuation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class UnitFile:
    sections: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    def values(self, section: str, key: str) -> list[str]:
        return [v for k, v in self.sections.get(section, []) if k == key]


def parse_unit(text: str) -> UnitFile:
    unit = UnitFile()
    section = None
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if pending and (line.startswith(("#", ";"))):
            continue  # comment inside a continuation
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            unit.sections.setdefault(section, [])
            continue
        if section is None or "=" not in line:
            raise ValueError(f"not a unit line: {line!r}")
        key, value = line.split("=", 1)
        unit.sections[section].append((key.strip(), value.strip()))
    return unit


def expand_specifiers(value: str, unit_name: str) -> str:
    prefix, _, rest = unit_name.partition("@")
    instance, _, _suffix = rest.rpartition(".")
    name_without_suffix = unit_name.rsplit(".", 1)[0]
    table = {"i": instance, "I": instance, "n": unit_name, "N": name_without_suffix, "p": prefix, "%": "%"}
    out, index = [], 0
    while index < len(value):
        char = value[index]
        if char == "%":
            spec = value[index + 1 : index + 2]
            if spec not in table:
                raise ValueError(f"unknown specifier %{spec} in {value!r}")
            out.append(table[spec])
            index += 2
        else:
            out.append(char)
            index += 1
    return "".join(out)


_C_ESCAPES = {
    "n": "\n",
    "t": "\t",
    "\\": "\\",
    '"': '"',
    "'": "'",
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "r": "\r",
    "v": "\v",
    "s": " ",
}


def split_words(value: str) -> list[tuple[str, bool]]:
    """Words of a command line: (text, was_quoted). Quotes group; C escapes apply."""
    words: list[tuple[str, bool]] = []
    index, length = 0, len(value)
    while index < length:
        while index < length and value[index].isspace():
            index += 1
        if index >= length:
            break
        current, quoted = [], False
        while index < length and not value[index].isspace():
            char = value[index]
            if char in "\"'":
                quoted = True
                end = index + 1
                while end < length and value[end] != char:
                    if value[end] == "\\" and end + 1 < length:
                        current.append(_C_ESCAPES.get(value[end + 1], value[end + 1]))
                        end += 2
                        continue
                    current.append(value[end])
                    end += 1
                if end >= length:
                    raise ValueError(f"unbalanced quote in {value!r}")
                index = end + 1
            elif char == "\\" and index + 1 < length:
                current.append(_C_ESCAPES.get(value[index + 1], value[index + 1]))
                index += 2
            else:
                current.append(char)
                index += 1
        words.append(("".join(current), quoted))
    return words


def _replace_braced(word: str, env: dict[str, str]) -> str:
    out, index = [], 0
    while index < len(word):
        if word.startswith("$$", index):
            out.append("$")
            index += 2
        elif word.startswith("${", index):
            end = word.find("}", index)
            if end < 0:
                out.append(word[index:])
                break
            out.append(env.get(word[index + 2 : end], ""))
            index = end + 1
        else:
            out.append(word[index])
            index += 1
    return "".join(out)


def expand_command(value: str, unit_name: str, env: dict[str, str]) -> list[str]:
    """ExecStart= value -> argv, as systemd runs it."""
    value = expand_specifiers(value, unit_name)
    while value and value[0] in "-@+!:":
        value = value[1:]  # exec prefixes
    argv: list[str] = []
    for word, quoted in split_words(value):
        if (
            not quoted
            and word.startswith("$")
            and not word.startswith("${")
            and not word.startswith("$$")
            and _VAR_NAME.fullmatch(word[1:])
        ):
            argv.extend(env.get(word[1:], "").split())
        else:
            argv.append(_replace_braced(word, env))
    return argv


def parse_env_file(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index].lstrip()
        index += 1
        if not line or line[0] in "#;":
            continue
        if "=" not in line:
            raise ValueError(f"not an assignment: {line!r}")
        key, rest = line.split("=", 1)
        key = key.strip()
        if not _VAR_NAME.fullmatch(key):
            raise ValueError(f"bad variable name {key!r}")
        value: list[str] = []
        position, state = 0, "plain"
        trailing_plain_space = 0
        while True:
            if position >= len(rest):
                if state == "double":  # a double-quoted value continues on the next line
                    if index >= len(lines):
                        raise ValueError(f"unterminated double quote in {key}")
                    value.append("\n")
                    rest, position = lines[index], 0
                    index += 1
                    continue
                if state == "single":
                    raise ValueError(f"unterminated single quote in {key}")
                break
            char = rest[position]
            if state == "plain":
                if char == "'":
                    state, trailing_plain_space = "single", 0
                elif char == '"':
                    state, trailing_plain_space = "double", 0
                elif char == "\\":
                    if position + 1 >= len(rest):  # line continuation
                        if index < len(lines):
                            rest, position = lines[index], -1
                            index += 1
                    else:
                        value.append(rest[position + 1])
                        position += 1
                    trailing_plain_space = 0
                elif char.isspace():
                    if value:
                        value.append(char)
                        trailing_plain_space += 1
                else:
                    value.append(char)
                    trailing_plain_space = 0
            elif state == "single":
                if char == "'":
                    state = "plain"
                else:
                    value.append(char)
            else:  # double
                if char == '"':
                    state = "plain"
                elif char == "\\" and position + 1 < len(rest):
                    nxt = rest[position + 1]
                    value.append(nxt if nxt in '"\\`$' else "\\" + nxt)
                    position += 1
                else:
                    value.append(char)
            position += 1
        text_value = "".join(value)
        if trailing_plain_space:
            text_value = text_value[: len(text_value) - trailing_plain_space]
        env[key] = text_value
    return env


def service_command(unit_text: str, unit_name: str, env_files: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of ExecStart for unit_name; env_files maps path -> file content.

    Environment= lines come first, then EnvironmentFile= in order (later wins), as systemd
    does; a `-` prefixed file may be missing, any other must be given.
    """
    unit = parse_unit(unit_text)
    env: dict[str, str] = {}
    for assignment in unit.values("Service", "Environment"):
        for word, _ in split_words(expand_specifiers(assignment, unit_name)):
            key, _, value = word.partition("=")
            env[key] = value
    for entry in unit.values("Service", "EnvironmentFile"):
        optional = entry.startswith("-")
        path = expand_specifiers(entry.lstrip("-"), unit_name)
        if path in env_files:
            env.update(parse_env_file(env_files[path]))
        elif not optional:
            raise FileNotFoundError(f"{unit_name}: EnvironmentFile {path} not given")
    starts = unit.values("Service", "ExecStart")
    if len(starts) != 1:
        raise ValueError(f"{unit_name}: expected one ExecStart, found {len(starts)}")
    return expand_command(starts[0], unit_name, env), env

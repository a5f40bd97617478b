"""The docs stay true to the code: every setting documented with its real default and environment
names, every `kvblend` command in the README a real subcommand with real flags, every make target
it names a real target, every docs link from the code a real heading; and no file speaks of the
work log that produced the project instead of the product."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import pytest
from pydantic import AliasChoices

from kvblend.cli import build_parser
from kvblend.config import Settings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# Words about how the project was built: numbered work rounds and tickets. Built from parts so
# that this file does not match itself.
WORK_LOG = re.compile(r"\b" + "stop" + r"s? [0-9]+|\b" + "issue" + r"s? #?[0-9]+", re.I)
SCANNED = [README, DOCS, ROOT / "kvblend", ROOT / "tests", ROOT / "benchmarks", ROOT / "experiments"]
TEXT_SUFFIXES = {".md", ".py", ".html", ".json", ".toml", ".txt", ".yaml", ".yml"}


def _files():
    for place in SCANNED:
        if place.is_file():
            yield place
        elif place.is_dir():
            yield from (p for p in sorted(place.rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES)


def test_no_file_speaks_of_the_work_log():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
             for p in _files() for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if WORK_LOG.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("text, hit", [("as measured in Sto" "p 23", True), ("iss" "ue #9's bars", True),
                                       ("iss" "ues 4", True), ("stops at layer 9", False), ("an issue", False)])
def test_the_work_log_pattern(text, hit):
    assert bool(WORK_LOG.search(text)) == hit


# --- configuration.md against Settings -------------------------------------------------------

def _documented_settings() -> dict[str, list[str]]:
    """setting -> the cells of its row in configuration.md's tables."""
    rows = {}
    for line in (DOCS / "configuration.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3:
            name = cells[0].strip("`")
            assert name not in rows, f"{name} is documented twice"
            rows[name] = cells
    return rows


def _parse_default(cell: str):
    text = cell.strip().strip("`")
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    if text.startswith("["):
        return [_parse_default(t) for t in text[1:-1].split(",") if t.strip()]
    words = {"none": None, "true": True, "false": False}
    if text in words:
        return words[text]
    return float(text) if "." in text or "e" in text else int(text)


def _same(documented, actual) -> bool:
    if isinstance(actual, list):
        return isinstance(documented, list) and len(documented) == len(actual) and all(
            _same(d, a) for d, a in zip(documented, actual))
    if isinstance(actual, float) and isinstance(documented, (int, float)) and not isinstance(documented, bool):
        return math.isclose(documented, actual, rel_tol=1e-9)
    return documented == actual and type(documented) is type(actual)


def _env_names(name: str, field) -> list[str]:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return [str(a) for a in alias.choices]
    return [f"KVBLEND_{name.upper()}"]


def test_configuration_md_documents_every_setting_with_its_default_and_environment_names():
    rows = _documented_settings()
    fields = Settings.model_fields
    assert sorted(rows) == sorted(fields), "configuration.md and Settings name different settings"
    for name, field in fields.items():
        default = field.get_default(call_default_factory=True)
        cells = rows[name]
        assert _same(_parse_default(cells[1]), default), f"{name}: documented {cells[1]}, actual {default!r}"
        documented_env = set(re.findall(r"[A-Z][A-Z0-9_]+", cells[2]))
        assert documented_env == set(_env_names(name, field)), f"{name}: environment names {cells[2]}"


def test_every_setting_has_its_flag_documented():
    from kvblend.cli_flags import CONFIG_ONLY

    flags = _flags(build_parser(), ["serve"])
    for name, cells in _documented_settings().items():
        flag = "--" + name.replace("_", "-")
        if name in CONFIG_ONLY:
            assert flag not in flags and not cells[3].strip(), name
        else:
            assert flag in flags and f"`{flag}`" in cells[3], f"{name}: flag {flag} missing or undocumented"


def test_configuration_md_flags_are_real():
    flags = _flags(build_parser(), ["serve"])
    for name, cells in _documented_settings().items():
        command = "eval" if "eval only" in cells[3] else "serve"
        for flag in re.findall(r"--[a-z0-9-]+", cells[3]):
            assert flag in _flags(build_parser(), [command]), f"{name}: {flag} is not a flag of kvblend {command}"
            assert command == "eval" or flag in flags


# --- README's commands against the CLI and the Makefile --------------------------------------

def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser, path: list[str]) -> set[str]:
    for word in path:
        parser = _subparsers(parser)[word]
    return {opt for action in parser._actions for opt in action.option_strings}


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S)


def _commands(block: str) -> list[str]:
    """Shell lines with their continuations joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def kvblend_calls(text: str) -> list[list[str]]:
    calls = []
    for block in _bash_blocks(text):
        for line in _commands(block):
            words = line.split()
            for i, word in enumerate(words):
                if (word == "kvblend" or word.endswith("bin/kvblend")) and i + 1 < len(words):
                    calls.append(words[i + 1:])
    return calls


def check_call(words: list[str]) -> list[str]:
    """What is wrong with `kvblend <words>`: an unknown subcommand or flag."""
    parser, path = build_parser(), []
    while words and words[0] in _subparsers(parser):
        parser = _subparsers(parser)[words[0]]
        path.append(words.pop(0))
    if not path:
        return [f"unknown subcommand in kvblend {' '.join(words)}"]
    flags = {opt for action in parser._actions for opt in action.option_strings}
    return [f"kvblend {' '.join(path)}: unknown flag {w.split('=')[0]}"
            for w in words if w.startswith("--") and w.split("=")[0] not in flags]


@pytest.mark.parametrize("page", ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))])
def test_kvblend_commands_name_real_subcommands_and_flags(page):
    calls = kvblend_calls((ROOT / page).read_text(encoding="utf-8"))
    if page == "README.md":
        assert len(calls) >= 5, "the README's quick start shows the CLI"
    problems = [p for call in calls for p in check_call(list(call))]
    assert not problems, "\n".join(problems)


def test_the_command_check_catches_a_wrong_flag_and_subcommand():
    assert check_call(["eval", "--data", "x", "--limit", "3"]) == []
    assert check_call(["store", "put", "--data", "x", "--local-disk", "d"]) == []
    assert check_call(["eval", "--rows", "3"]) == ["kvblend eval: unknown flag --rows"]
    assert check_call(["evaluate"]) == ["unknown subcommand in kvblend evaluate"]


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def test_readme_make_targets_exist():
    named = set()
    for block in _bash_blocks(README.read_text(encoding="utf-8")):
        for line in _commands(block):
            named.update(re.findall(r"(?:^|&&\s*)make ([\w-]+)", line))
    assert {"demo", "test"} <= named, "the README shows the two commands"
    assert named <= _make_targets(), f"not in the Makefile: {named - _make_targets()}"


def test_readme_scripts_exist():
    text = README.read_text(encoding="utf-8")
    for block in _bash_blocks(text):
        for path in re.findall(r"\b((?:benchmarks|experiments)/[\w/]+\.py)", block):
            assert (ROOT / path).is_file(), path


def test_readme_stays_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 320


# --- links into docs/ ----------------------------------------------------------------------

def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", md.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_docs_links_resolve():
    broken = []
    sources = [README, *DOCS.glob("*.md"), *(ROOT / "kvblend").rglob("*.py")]
    for src in sources:
        for target, anchor in re.findall(r"((?:docs/)?[\w-]+\.md)#([\w-]+)", src.read_text(encoding="utf-8")):
            md = ROOT / target if target.startswith("docs/") else (src.parent / target)
            if not md.is_file():
                md = DOCS / Path(target).name
            if not md.is_file() or anchor not in _anchors(md):
                broken.append(f"{src.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, "\n".join(broken)


@pytest.mark.real_model
def test_readme_python_quick_start_runs_as_written(capsys):
    """The README's Python block on the default model, exactly as a reader would paste it."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    quick_start = [b for b in blocks if "from kvblend import" in b]
    assert len(quick_start) == 1
    exec(compile(quick_start[0], "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    # Stored ahead: the first chunk comes exact from the prefix cache, the other from memory.
    assert printed[-1].endswith("['prefix', 'memory']"), printed

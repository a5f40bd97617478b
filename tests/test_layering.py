"""kvblend's layers, lowest first: config <- model <- store <- blend <- engine <- api/eval <- server
<- cli (the vLLM connector sits beside the server). A module may import its own layer and the layers below it, never one above: the store knows
nothing of the engine that reads it, the engine nothing of the server that drives it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvblend"

# The first part of a module's name under kvblend/ decides its layer.
LAYERS = {
    "config": 0,
    "model": 1,
    "store": 2,
    "blend": 3,
    "engine": 4,
    "api": 5,
    "eval": 5,
    "train": 5,
    "server": 6,
    "vllm": 6,  # the vLLM connector: beside the server, another host of the engine
    "cli": 7,
    "cli_store": 7,
    "cli_adapter": 7,
    "cli_flags": 7,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every kvblend import in the file, function-level ones too."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from . import cli_store` names a module, not an attribute.
            targets = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            found += [(node.lineno, t) for t in targets]
    return [(line, t) for line, t in found if t == "kvblend" or t.startswith("kvblend.")]


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def upward_imports(path: Path) -> list[str]:
    here = layer(module_name(path))
    if here is None:  # kvblend/__init__.py, the package's face, and data-only packages
        return []
    return [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            for line, target in imported_modules(path)
            if (there := layer(target)) is not None and there > here]


def test_every_module_has_a_layer():
    unplaced = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                if p != PACKAGE / "__init__.py" and p.parent.name != "demo" and layer(module_name(p)) is None]
    assert not unplaced, f"add these to LAYERS: {unplaced}"


def test_no_import_runs_up_a_layer():
    broken = [b for p in sorted(PACKAGE.rglob("*.py")) for b in upward_imports(p)]
    assert not broken, "imports from a lower layer to a higher one:\n" + "\n".join(broken)


@pytest.mark.parametrize("source, expected", [
    ("from ..api import LLM\n", ["kvblend/store/x.py:1 imports kvblend.api"]),
    ("def f():\n    from ..eval.harness import prompt_ids\n", ["kvblend/store/x.py:2 imports kvblend.eval.harness"]),
    ("from .tiered import build_store\nfrom ..config import Settings\nfrom ..model import rotary\n", []),
])
def test_the_check_sees_relative_and_function_level_imports(tmp_path, monkeypatch, source, expected):
    fake = tmp_path / "kvblend"
    (fake / "store").mkdir(parents=True)
    (fake / "store" / "x.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert upward_imports(fake / "store" / "x.py") == expected


def test_the_offline_engine_imports_without_the_extras():
    """`pip install kvblend` (no [server], [redis] or [eval] extra) gives LLM: importing kvblend
    neither needs nor loads fastapi, uvicorn, prometheus-client, redis, matplotlib or rouge-score."""
    import subprocess

    extras = ["fastapi", "uvicorn", "prometheus_client", "redis", "matplotlib", "rouge_score"]
    code = ("import sys\n"
            f"for name in {extras!r}:\n"
            "    sys.modules[name] = None  # as if not installed: importing it raises\n"
            "import kvblend\n"
            "from kvblend import LLM, SamplingParams\n"
            "from kvblend.engine.engine import Engine\n"
            "from kvblend.store.tiered import build_store\n"
            "from kvblend.config import Settings\n"
            "build_store(Settings(local_disk=sys.argv[1]), None)\n"
            "try:\n"
            "    build_store(Settings(remote_url='redis://127.0.0.1:1'), None)\n"
            "except ValueError as e:\n"
            "    assert \"kvblend[redis]\" in str(e), e\n"
            "else:\n"
            "    raise AssertionError('a Redis tier without redis-py')\n")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        done = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_command_whose_extra_is_missing_says_which_to_install(monkeypatch, capsys):
    import kvblend.cli as cli

    def needs_fastapi(args):
        raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["serve"].set_defaults(func=needs_fastapi)
    assert cli.main(["serve"]) == 2
    assert "pip install 'kvblend[server]'" in capsys.readouterr().err


def test_scripts_import_shared_helpers_from_the_package_not_through_sys_path():
    """Benchmarks and experiments share helpers through kvblend.eval (dev_records, flops,
    variants); a script's own folder is on its path by itself. sys.path edits hide a dependency."""
    root = PACKAGE.parent
    found = [f"{p.relative_to(root)}:{n}" for folder in ("benchmarks", "experiments")
             for p in sorted((root / folder).glob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "sys.path.insert" in line]
    assert not found, found

"""The README's shell recipes run as written, on the default model: the lines are read from the
README itself, with only the store folder, the files and a free port filled in."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import httpx
import pytest
from redis_server import free_port
from serving import stop, wait_healthy

from kvblend.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.real_model

DOCS = {"bridge.txt": "The Sorrel Bridge crosses the Tesk River. It has seven arches of red sandstone.",
        "town.txt": "Marrowick is a small town in the valley of the Tesk River, founded in 1742 by Elsbeth Varn."}


def recipe_lines(section: str) -> list[str]:
    """The `kvblend` command lines of the README section under this heading, comments cut off."""
    text = README.read_text(encoding="utf-8")
    body = text.split(section, 1)[1].split("\n### ", 1)[0]
    return [line.split("  #")[0].strip() for line in re.findall(r"^kvblend .*$", body, re.M)]


def test_the_store_then_serve_recipe_serves_what_was_put(tmp_path, warm_python):
    lines = recipe_lines("### Storing documents ahead")
    put = next(line for line in lines if line.startswith("kvblend store put corpus/"))
    serve = next(line for line in lines if line.startswith("kvblend serve"))
    store, corpus = tmp_path / "kv", tmp_path / "corpus"
    corpus.mkdir()
    for name, text in DOCS.items():
        (corpus / name).write_text(text)

    def filled(line: str) -> list[str]:
        words = []
        for w in shlex.split(line)[1:]:
            w = str(store) if w == "~/.cache/kvblend/kv" else w
            words += sorted(str(p) for p in corpus.glob("*.txt")) if w == "corpus/*.txt" else [w]
        return words

    assert main(filled(put)) == 0
    args = filled(serve)
    key = args[args.index("--api-key") + 1]
    port = free_port()
    proc = warm_python.start(["-m", "kvblend.cli", *args, "--port", str(port)], Path.cwd(),
                             {**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        body = {"model": "smollm2-135m-instruct", "prompt": "How many arches does the bridge have?",
                "documents": [DOCS["town.txt"], DOCS["bridge.txt"]], "max_tokens": 1}
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
        assert r.status_code == 200, r.text
        # The key reads what `put` stored: the first document exact, the other from the disk tier.
        assert r.json()["kvblend"]["chunk_tiers"] == ["prefix", "disk"], r.json()["kvblend"]
    finally:
        stop(proc)

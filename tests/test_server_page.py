"""The try-it page in headless Chromium (Debian's `chromium`; `make setup` installs it where apt
can): the page stores the documents, asks blend and full, and shows both answers with TTFT and
tokens recomputed. A screenshot is kept in pytest's tmp dir."""

import shutil
import subprocess
from urllib.parse import urlencode

import pytest
from serving import live_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")


def chromium(*args: str) -> str:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--virtual-time-budget=60000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout


def test_page_shows_blend_beside_full(tmp_path):
    with live_server(api_keys=["sk-page"]) as (url, app):
        query = urlencode({"documents": "The Sorrel Bridge has seven arches.\n\nMarrowick lies on the Tesk.",
                           "question": "How many arches?", "key": "sk-page", "run": "1"})
        page = f"{url}/?{query}"
        dom = chromium("--dump-dom", page)
        for mode in ("blend", "full"):
            section = dom.split(f'<section id="{mode}"', 1)[1].split("</section>", 1)[0]
            assert 'data-done="1"' in section and "TTFT" in section and "recomputed" in section, section
        assert "chunk hits 2" in dom  # the page stored the documents first, so blend reused both
        shot = tmp_path / "page.png"
        chromium(f"--screenshot={shot}", "--window-size=1100,900", page)
        assert shot.stat().st_size > 10_000

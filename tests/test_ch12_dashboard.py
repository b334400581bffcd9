"""The live dashboard in a real headless browser (Debian's Chromium driven by Playwright).

While requests run, the page's counters must show them (running > 0, pages in use, tokens growing)
and go back to zero afterwards. Set DASHBOARD_SCREENSHOT=path to keep the mid-run screenshot.
"""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from helpers.serve import MODEL_NAME

CHROMIUM = next((p for p in (os.environ.get("CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser"))
                 if p), None)
playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the Python package only)")
if CHROMIUM is None:
    pytest.skip("no chromium binary (apt-get install -y chromium, or set CHROMIUM=/path)", allow_module_level=True)

from engine.runtime.llm import LLM  # noqa: E402
from engine.serve.server import ServerThread  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    llm = LLM(tiny_chat_dir, backend="numpy", kv_cache_mib=0.5, max_context=256, max_seqs=6)
    with ServerThread(llm, MODEL_NAME) as running:
        yield running, llm


@pytest.fixture(scope="module")
def page():
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield browser.new_page(viewport={"width": 1180, "height": 900})
        browser.close()


def counter(page, name: str) -> str:
    return page.text_content(f"#{name}")


def send_requests(url: str, n: int, max_tokens: int, prompt: str | None = None) -> list[threading.Thread]:
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def one(i):
        client.completions.create(model=MODEL_NAME, prompt=prompt or f"request {i} " * (3 + i), max_tokens=max_tokens,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_dashboard_counts_follow_the_load(server, page, tmp_path):
    srv, llm = server
    page.goto(srv.url + "/")
    page.wait_for_function("document.getElementById('connection').textContent === 'live'", timeout=15000)
    assert counter(page, "model") == MODEL_NAME
    page.wait_for_function("document.getElementById('running').textContent === '0'", timeout=15000)
    tokens_before = int(counter(page, "tokens"))

    threads = send_requests(srv.url, n=10, max_tokens=120)     # 10 requests, 6 seats: some must wait
    page.wait_for_function("Number(document.getElementById('running').textContent) > 0", timeout=30000)
    page.wait_for_function("Number(document.getElementById('waiting').textContent) > 0", timeout=30000)
    used, total = (int(x) for x in counter(page, "pages").split(" / "))
    assert 0 < used <= total == llm.stats()["pages_total"]
    page.wait_for_timeout(1500)      # let the timeline and the rate plot fill in
    shot = Path(os.environ.get("DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    # The page map shows the held pages in colour: count the non-grey cells the canvas drew.
    coloured = page.evaluate("""() => {
        const c = document.getElementById('pagemap'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i+3] > 0 && !(d[i] === d[i+1] && d[i+1] === d[i+2])) n++;
        return n; }""")
    assert coloured > 0

    for t in threads:
        t.join(timeout=120)
    page.wait_for_function("document.getElementById('running').textContent === '0' && "
                           "document.getElementById('waiting').textContent === '0'", timeout=30000)
    assert counter(page, "pages").startswith("0 / ")
    assert int(counter(page, "tokens")) >= tokens_before + 10 * 120
    assert float(counter(page, "tps")) >= 0

    # the same long prompt twice: the second finds the first's pages, and the page shows the hits
    for t in send_requests(srv.url, n=1, max_tokens=4, prompt="one shared system prompt " * 20):
        t.join(timeout=120)
    for t in send_requests(srv.url, n=1, max_tokens=4, prompt="one shared system prompt " * 20):
        t.join(timeout=120)
    page.wait_for_function("!document.getElementById('prefix').textContent.startsWith('0%') && "
                           "document.getElementById('prefix').textContent !== '–'", timeout=30000)
    assert "cached" in counter(page, "prefix") and llm.stats()["prefix_cache"]["hit_tokens"] > 0

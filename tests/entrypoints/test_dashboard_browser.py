"""/dashboard in a real browser: Debian's Chromium, headless, driven by Playwright, against a real server
started with --api-key (the page takes the key from its #key= fragment).

Skips when Playwright or Chromium is missing (`make setup` installs Chromium where apt-get can).
`PAGEDLLM_DASHBOARD_SCREENSHOT=docs/dashboard.png pytest tests/entrypoints/test_dashboard_browser.py`
also saves the page after the traffic: the README's picture.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ..helpers import RemoteServer, server_engine_args

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright is not installed: pip install -c constraints.txt -e '.[dev]'"
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,  # a browser and a server of its own
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no Chromium on PATH: apt-get install chromium (`make setup` does it as root)",
    ),
]

API_KEY = "browser-key"
MODEL = "SmolLM2-135M-Instruct"
MARKUP_CALLER = "<b>x</b><script>window.pwned=1</script>"
SYSTEM = "You are a careful assistant. Answer in one short sentence and cite no sources. " * 6
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def server():
    remote = RemoteServer([*server_engine_args(), "--api-key", API_KEY])
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: Chromium's sandbox refuses to start as root (CI and containers)
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


def open_dashboard(browser, server):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{server.url}/dashboard#key={API_KEY}")
    page.wait_for_function("() => document.getElementById('model').textContent !== ''", timeout=WAIT_MS)
    return page


def complete(server, prompt: str, user: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "user": user}
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={**body, "ignore_eos": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=300,
    )
    response.raise_for_status()
    return response.json()


def wait_for_text(page, element_id: str, text: str) -> None:
    page.wait_for_function(
        f"() => document.getElementById({element_id!r}).textContent.includes({text!r})", timeout=WAIT_MS
    )


def click_a_held_block(page) -> None:
    """Click the first block a request holds, where the page drew it."""
    x, y = page.evaluate(
        """() => { const i = blockStates.search(/[us]/);
                   return [(i % columns + .5) * cell, (Math.floor(i / columns) + .5) * cell]; }"""
    )
    page.locator("#blocks").click(position={"x": x, "y": y})


def test_dashboard_follows_traffic(server, browser, tmp_path):
    page = open_dashboard(browser, server)
    assert page.locator(".uplot").count() == 4 and page.locator("#error").text_content() == ""
    page.wait_for_function("() => blockStates.length > 0 && !/[us]/.test(blockStates)", timeout=WAIT_MS)

    # The divergence panel: prompts that differ in the middle only.
    rules = "Answer briefly and cite sources. " * 12
    for second in (7, 9, 11):
        complete(server, f"Support bot. Time: 10:41:{second:02d}\n{rules}Q: hi", "support", 1)
    wait_for_text(page, "divergence", "10:41:")

    # Requests with one system prompt: their blocks show up held (the shared prefix shared), and
    # a clicked block names the requests that hold it.
    questions = ["Why is the sky blue?", "What is a prime?", "Name a river.", "What is rain?"]
    with ThreadPoolExecutor(len(questions) + 1) as pool:
        running = [
            pool.submit(complete, server, SYSTEM + q, f"caller-{i}", 128) for i, q in enumerate(questions)
        ]
        running.append(pool.submit(complete, server, SYSTEM + "Say hi.", MARKUP_CALLER, 128))
        page.wait_for_function("() => /[us]/.test(blockStates)", timeout=WAIT_MS)
        click_a_held_block(page)
        wait_for_text(page, "block_holders", "cmpl-")
        page.wait_for_function("() => charts.requests.data[1].some(v => v > 0)", timeout=WAIT_MS)
        screenshot = os.environ.get("PAGEDLLM_DASHBOARD_SCREENSHOT")
        page.screenshot(path=screenshot or tmp_path / "dashboard.png", full_page=True)
        for future in running:
            future.result()
    # Finished requests let their blocks go (the followed block has no holders left); the prompts'
    # full blocks stay cached for later hits.
    page.wait_for_function("() => !/[us]/.test(blockStates) && blockStates.includes('c')", timeout=WAIT_MS)
    page.wait_for_function("() => outlined.size === 0", timeout=WAIT_MS)
    page.wait_for_function(
        "() => charts.throughput.data[1].some(v => v > 0) && charts.cache.data[2].some(v => v !== null)",
        timeout=WAIT_MS,
    )

    # A caller's name is text, never markup.
    wait_for_text(page, "by_user", MARKUP_CALLER)
    assert page.locator("#by_user b, #by_user script, #block_holders b").count() == 0
    assert page.evaluate("window.pwned") is None
    page.close()

    # A page opened now draws the last minutes at once: the history is kept by the server.
    fresh = open_dashboard(browser, server)
    fresh.wait_for_function("() => charts.throughput.data[1].some(v => v > 0)", timeout=5_000)
    fresh.close()


def test_gaps_break_the_lines_and_empty_panels_say_so(browser):
    """The page on canned /stats answers, no server: samples minutes apart get a null between
    them (no line slides across an idle stretch), nulls stay nulls, the block map's states are
    explained in words, and an empty divergence table says "none found"."""
    from pathlib import Path

    from pagedllm.metrics.live_stats import Sample

    page_dir = Path(__file__).parents[2] / "pagedllm" / "entrypoints" / "openai"
    times = [1000.0, 1002.0, 1004.0, 1664.0, 1666.0]  # 11 idle minutes after the third sample
    history = {name: [0.5] * len(times) for name in Sample._fields} | {"time": times}
    history["hit_rate"] = [0.95, 0.95, None, 0.0, 0.0]
    stats = {
        "model": "canned", "running": 0, "waiting": 0, "finished": 3, "preemptions": 0,
        "kv_cache": {"usage": 0.1, "num_blocks": 4, "block_size": 16},
        "prompt_tokens_computed": 10, "generation_tokens": 5,
        "prefix_cache": {"hit_rate": 0.5, "preempted_recompute_saved": 0, "by_prompt_length": {},
                         "by_user": {}},
        "latency_s": {}, "window": 3, "history": history, "prefix_divergence": [],
    }  # fmt: skip
    blocks = {"num_blocks": 4, "states": ".cus", "counts": {"free": 1, "cached": 1, "used": 1, "shared": 1}}

    def answer(route):
        path = route.request.url.split("dash.test", 1)[1].split("#")[0]
        if path == "/dashboard":
            return route.fulfill(body=(page_dir / "dashboard.html").read_text(), content_type="text/html")
        if path.startswith("/static/"):
            return route.fulfill(path=page_dir / path.lstrip("/"))
        return route.fulfill(json=stats if path == "/stats" else blocks)

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.route("http://dash.test/**", answer)
    page.goto("http://dash.test/dashboard")
    page.wait_for_function("() => charts.cache.data[0].length > 0 && blockStates.length", timeout=WAIT_MS)
    x, hit_rate = page.evaluate("() => [charts.cache.data[0], charts.cache.data[2]]")
    assert x == [1000.0, 1002.0, 1004.0, 1006.0, 1664.0, 1666.0]  # the gap's null at 1006
    assert hit_rate == [95.0, 95.0, None, None, 0.0, 0.0]
    assert page.evaluate("() => charts.cache.series.every(s => !s.spanGaps)")
    meaning = page.locator("#block_meaning").text_content()
    for name in ("Free", "Cached", "Used", "Shared"):
        assert f"{name}: " in meaning
    assert page.locator("#divergence").text_content().startswith("none found")
    assert page.locator("#divergence th").count() == 0
    assert page.locator("#error").text_content() == ""
    page.close()


def test_a_speculating_server_charts_and_counts_its_drafts(browser):
    """With --speculative-config the page adds the acceptance chart and two cards."""
    remote = RemoteServer(
        [*server_engine_args(), "--api-key", API_KEY, "--speculative-config", '{"method": "ngram"}']
    )
    try:
        page = open_dashboard(browser, remote)
        complete(remote, "one two three four five. " * 6 + "one two", "spec", 24)
        page.wait_for_function("() => document.querySelectorAll('.uplot').length === 5", timeout=WAIT_MS)
        wait_for_text(page, "cards", "draft tokens accepted")
        assert page.locator("#error").text_content() == ""
    finally:
        remote.stop()

"""/dashboard: the live page, its data and its auth; loaded in a real headless Chromium, the
numbers it shows match /metrics.

The browser test needs Debian's chromium and chromium-driver (`.ci/run` installs them). Without
them it is skipped, except where FLOWLANG_REQUIRE_BROWSER is set (`.ci/run` sets it): there a
missing browser fails the run.
"""

from __future__ import annotations

import base64
import os
import pathlib
import re
import shutil
import xml.etree.ElementTree as ET

import httpx
import pytest
from conftest import ServerThread

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
KEY, ADMIN_KEY, OTHER_KEY = "user-key-1", "admin-key-1", "user-key-2"


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    thread = ServerThread(
        Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=16_384)),
        api_keys=(KEY, OTHER_KEY),
        admin_keys=(ADMIN_KEY,),
    )
    yield thread
    thread.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def basic(key: str, user: str = "me") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()}


def metrics(url: str, key: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers=bearer(key)).text
    found = re.findall(r"^flowlang_(\w+) ([0-9.e+-]+)$", text, re.M)
    return {name: float(value) for name, value in found}


def generate(url: str, key: str, text: str, max_new_tokens: int = 6) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    response = httpx.post(f"{url}/generate", json=body, headers=bearer(key), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_page_and_its_data_need_a_key_and_a_browser_may_send_it_as_basic_auth(keyed):
    url = keyed.url
    for path in ("/dashboard", "/dashboard/data"):
        refused = httpx.get(url + path)
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith('Basic realm="flowlang"')
        assert httpx.get(url + path, headers=basic("wrong")).status_code == 401
        assert httpx.get(url + path, headers=basic(KEY)).status_code == 200
        assert httpx.get(url + path, headers=bearer(KEY)).status_code == 200
    # Basic auth is for the page a browser opens, not a second way into the API
    assert httpx.get(f"{url}/metrics", headers=basic(KEY)).status_code == 401
    assert "www-authenticate" not in httpx.get(f"{url}/metrics").headers
    page = httpx.get(f"{url}/dashboard", headers=bearer(KEY))
    assert page.headers["content-type"].startswith("text/html")
    assert 'data-stat="prefill_tokens_total"' in page.text


def test_data_has_the_metrics_numbers_and_the_tree_and_hides_other_tenants_text(keyed):
    url = keyed.url
    generate(url, OTHER_KEY, "Zebras graze quietly on the savanna at dawn.")
    generate(url, KEY, "Penguins huddle together through the polar winter.")
    mine = httpx.get(f"{url}/dashboard/data", headers=bearer(KEY)).json()
    shown = metrics(url, KEY)
    for name, value in mine["stats"].items():
        assert value == pytest.approx(shown[name]), name
    tree = mine["tree"]
    root = ET.fromstring(tree["svg"])
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    # another tenant's namespace is left out whole, not drawn with its text hidden
    assert "Penguins" in texts and "Zebras" not in texts and "(hidden)" not in texts
    assert tree["total_tokens"] == shown["cache_tokens"]
    admin = httpx.get(f"{url}/dashboard/data", headers=bearer(ADMIN_KEY)).json()
    root = ET.fromstring(admin["tree"]["svg"])
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "Penguins" in texts and "Zebras" in texts


def browser_or_skip(tmp_path: pathlib.Path):
    """A headless Chromium driven through chromedriver (both from Debian's packages)."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        if os.environ.get("FLOWLANG_REQUIRE_BROWSER"):
            pytest.fail(f"CI needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium ...)")
        pytest.skip("Debian's chromium and chromium-driver are not installed")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",  # this machine's network is closed
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--window-size=1400,1800",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def test_the_page_renders_in_chromium_and_shows_what_metrics_says(keyed, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.wait import WebDriverWait

    url = keyed.url
    for i in range(3):
        generate(url, ADMIN_KEY, f"Request number {i}: tell me about lighthouses.", 8)
    ids = httpx.post(
        f"{url}/v1/flowlang/tokenize",
        json={"text": "A prefix held for later branches: lighthouses guide ships."},
        headers=bearer(ADMIN_KEY),
    ).json()["ids"]
    pin = httpx.post(
        f"{url}/v1/flowlang/pin",
        json={"prefix_ids": ids, "lease_seconds": 600},
        headers=bearer(ADMIN_KEY),
    )
    assert pin.status_code == 200, pin.text
    expected = metrics(url, ADMIN_KEY)
    driver = browser_or_skip(tmp_path)
    try:
        # a browser would ask for the key once; the test sends it as that answer would
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": basic(ADMIN_KEY)})
        driver.get(f"{url}/dashboard")
        WebDriverWait(driver, 60).until(
            lambda d: (
                int(d.find_element(By.TAG_NAME, "body").get_attribute("data-samples") or 0) >= 2
            )
        )
        status = driver.find_element(By.ID, "status")
        assert status.get_attribute("class") != "error", status.text
        # one read in the page's own event loop: the next poll redraws the tree and the pins
        # while an element-by-element read would still be going (stale elements)
        page = driver.execute_script(
            """
            const texts = (selector) =>
              [...document.querySelectorAll(selector)].map((el) => el.textContent.trim());
            return {
              shown: Object.fromEntries([...document.querySelectorAll("[data-stat]")].map(
                (el) => [el.getAttribute("data-stat"), el.innerText.trim()])),
              tree: texts("#tree svg text"),
              pins: [...document.querySelectorAll("#pins tbody tr")].map((el) => el.innerText),
              lines: document.querySelectorAll("#chart-tokens polyline").length,
            };
            """
        )
        shown, tree_texts, pin_rows = page["shown"], page["tree"], page["pins"]
        chart_lines = page["lines"]
        driver.save_screenshot(str(tmp_path / "dashboard.png"))
    finally:
        driver.quit()
    assert metrics(url, ADMIN_KEY) == expected, "the server was not idle while the page looked"
    assert len(shown) == 14
    for name, text in shown.items():
        if name == "cache_hit_rate":
            assert float(text.rstrip("%")) == pytest.approx(100 * expected[name], abs=0.05)
        elif name == "spec_mean_accepted_length":
            assert float(text) == pytest.approx(expected[name], abs=0.005)
        else:
            assert int(text.replace(",", "")) == expected[name], name
    assert expected["requests_finished_total"] >= 3 and expected["num_pins"] == 1
    assert any("tok" in t for t in tree_texts) and any("pinned" in t for t in tree_texts)
    assert len(pin_rows) == 1 and pin.json()["pin_id"] in pin_rows[0]
    assert chart_lines == 2
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_open_pages_share_one_tree_view_and_a_busy_engine_builds_it_once_a_second():
    import asyncio

    from runtime.server.dashboard import TreeViews

    class Engine:
        calls = 0

        def cache_view(self, max_nodes):
            Engine.calls += 1
            return f"view {Engine.calls}"

    async def main() -> list[str]:
        views, engine = TreeViews(busy_interval_s=3600), Engine()
        idle = {"steps_total": 1, "cache_tokens": 10, "num_running": 0}
        busy = {"steps_total": 2, "cache_tokens": 12, "num_running": 1}
        return [
            await views.get(engine, idle),
            await views.get(engine, idle),  # nothing changed: the same view
            await views.get(engine, {**idle, "cache_tokens": 11}),  # idle and changed: rebuilt
            await views.get(engine, busy),  # busy, rebuilt within the interval: kept
            await views.get(engine, {**busy, "steps_total": 3}),
        ]

    assert asyncio.run(main()) == ["view 1", "view 1", "view 2", "view 2", "view 2"]
    assert Engine.calls == 2


def test_a_server_without_keys_serves_the_page_to_anyone(served):
    page = httpx.get(f"{served.url}/dashboard")
    assert page.status_code == 200 and "www-authenticate" not in page.headers
    data = httpx.get(f"{served.url}/dashboard/data").json()
    assert data["stats"]["kv_slots_total"] == 20_000
    ET.fromstring(data["tree"]["svg"])  # well-formed

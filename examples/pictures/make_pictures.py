"""Make the README's pictures on the default model: a request graph, the radix tree after a
batch with a pin held, and the live dashboard, each as PNG (and the two drawings as SVG).

    .venv/bin/python examples/pictures/make_pictures.py [--model smollm2-135m-instruct]

SVG is turned into PNG, and the dashboard photographed, by Debian's headless Chromium
(`apt-get install chromium chromium-driver`).
"""

from __future__ import annotations

import argparse
import base64
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from flowlang.backends.local import LocalBackend
from programs import support_agent
from programs.brainstorm import brainstorm
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.prefix import common_prefix_len

HERE = pathlib.Path(__file__).resolve().parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
)
KEY = "pictures-key"


def svg_to_png(svg: str, name: str) -> None:
    """Write `name`.svg and a PNG of it (Chromium's screenshot at the drawing's own size)."""
    svg_path, png_path = HERE / f"{name}.svg", HERE / f"{name}.png"
    svg_path.write_text(svg, encoding="utf-8")
    width, height = (
        int(float(v)) for v in re.search(r'width="([\d.]+)" height="([\d.]+)"', svg).groups()
    )
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
             f"--window-size={width},{height}", f"--screenshot={png_path}", svg_path.as_uri()],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    print(f"wrote {png_path.relative_to(HERE.parents[1])} ({width}x{height})")


def dashboard_png(engine: Engine) -> None:
    """Serve `engine`, put some work through it, and photograph /dashboard after a while."""
    import uvicorn
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from runtime.server.app import ServerSettings, create_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # an admin key sees every namespace's text (the batch above ran in the default one)
    app = create_app(engine, ServerSettings(port=port, admin_keys=(KEY,)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {KEY}"}
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp()
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1400,1500"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        basic = base64.b64encode(f"me:{KEY}".encode()).decode()
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd(
            "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {basic}"}}
        )
        driver.get(f"{url}/dashboard")
        topics = ["tea", "bicycles", "lighthouses", "gardens", "trains", "rivers"]
        with httpx.Client(headers=auth, timeout=120) as client:
            for i in range(12):  # a request or two a second, so the charts have a shape
                text = f"Tell me one fact about {topics[i % len(topics)]}."
                body = {"text": text, "sampling_params": {"max_new_tokens": 24}}
                client.post(f"{url}/generate", json=body)
                time.sleep(0.5)
            ids = client.post(
                f"{url}/v1/flowlang/tokenize", json={"text": "A pinned prefix: tell me about"}
            ).json()["ids"]
            client.post(f"{url}/v1/flowlang/pin", json={"prefix_ids": ids, "lease_seconds": 60})
            time.sleep(2.5)
        path = HERE / "dashboard.png"
        driver.save_screenshot(str(path))
        print(f"wrote {path.relative_to(HERE.parents[1])}")
    finally:
        driver.quit()
        server.should_exit = True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, max_kv_tokens=40_000))
    try:
        backend = LocalBackend(engine)
        svg_to_png(brainstorm.compile("saving energy at home", backend=backend).to_svg(), "graph")
        inputs = support_agent.make_inputs(engine.tokenizer, "test")
        batch = support_agent.batch_args(inputs)
        support_agent.support_agent.run_batch(batch, backend=backend, progress=False)
        firsts = [
            support_agent.support_agent.compile(backend=backend, **args).first_prompt()
            for args in batch[:2]
        ]
        shared = common_prefix_len(*firsts)  # the system prompt and few-shot block, templated
        pin = engine.pin(list(firsts[0][:shared]))
        svg_to_png(engine.cache_view(max_nodes=24).to_svg(), "radix_tree")
        pin.release()
        dashboard_png(engine)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

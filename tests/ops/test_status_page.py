"""/status in a real headless Chromium after the demo's traffic, and who may see it."""

from __future__ import annotations

import base64
import html.parser
import re
import signal
import subprocess
import sys
import time

import pytest
from ops_helpers import (
    REPO,
    chromium,
    count_color,
    get_text,
    png_pixels,
)

from proxy.testing import running_proxy

# The page's highlight colours (proxy/status.py's CSS).
BAD_BG = (0xFF, 0xD7, 0xD5)
OK_BG = (0xDA, 0xFB, 0xE1)


class _Rows(html.parser.HTMLParser):
    """Collects the attributes of every element carrying a data-* attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.tagged: list[tuple[str, dict[str, str]]] = []
        self.meta: list[dict[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {k: v or "" for k, v in attrs}
        if any(k.startswith("data-") for k in found):
            self.tagged.append((tag, found))
        if tag == "meta":
            self.meta.append(found)


def _start_demo() -> tuple[subprocess.Popen[str], dict[str, str]]:
    """``kvguard demo --keep``; returns it and the URLs it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvguard.cli", "demo", "--keep", "--requests", "16"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    out = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line)
        if "Status page:" in line:
            text = "".join(out)
            prefills = re.search(r"prefills (\S+) \(good\), (\S+) \(corrupting\)", text)
            status = re.search(r"Status page: (\S+)", text)
            assert prefills and status, text
            assert "16 / 16" in text, text
            return proc, {
                "good": prefills.group(1),
                "bad": prefills.group(2),
                "status": status.group(1),
            }
    proc.kill()
    proc.wait()
    pytest.fail("kvguard demo --keep printed no status URL:\n" + "".join(out))


def test_status_page_highlights_the_corrupting_prefill_in_chromium(tmp_path):
    pytest.importorskip("torch")
    proc, urls = _start_demo()
    try:
        shot = tmp_path / "status.png"
        # One page load: its screenshot to a file, its DOM to stdout.
        dom = chromium(
            "--window-size=1280,900",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            "--dump-dom",
            urls["status"],
            profile=tmp_path / "profile",
        )
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, "the demo did not stop cleanly on Ctrl-C"

    page = _Rows()
    page.feed(dom)
    # The page refreshes itself.
    assert any(m.get("http-equiv") == "refresh" for m in page.meta)
    states = {
        a["data-url"]: a["data-state"]
        for tag, a in page.tagged
        if tag == "tr" and a.get("data-role") == "prefill"
    }
    assert states == {urls["bad"]: "ejected", urls["good"]: "in-rotation"}
    headers = {
        a["data-prefill"]: a.get("class", "")
        for _, a in page.tagged
        if "data-prefill" in a
    }
    assert headers[urls["bad"]] == "bad" and headers[urls["good"]] == ""
    cells = {
        a["data-pair"].split()[0]: (int(a["data-failures"]), a["class"])
        for _, a in page.tagged
        if "data-pair" in a
    }
    bad_failures, bad_class = cells[urls["bad"]]
    assert bad_failures >= 3 and "bad" in bad_class
    assert cells[urls["good"]] == (0, "n ok")
    # The last failures list the corrupting prefill with request ids.
    recent = dom[dom.index('id="recent"') :]
    assert urls["bad"] in recent and urls["good"] not in recent
    assert re.search(r"<code>[0-9a-f]{32}</code>", recent)
    assert "kv_integrity" in dom  # retries by reason

    width, height, rows = png_pixels(shot)
    assert (width, height) == (1280, 900)
    # Highlighted (failing) cells and the clean pair's green are on screen.
    assert count_color(rows, BAD_BG) > 5000
    assert count_color(rows, OK_BG) > 1000


async def test_status_page_needs_the_admin_key_when_one_is_configured(monkeypatch):
    monkeypatch.setenv("KVGUARD_TEST_ADMIN_KEY", "s3cret")
    config = {
        "models": {
            "m": {
                "prefill": {"instances": [{"url": "http://127.0.0.1:9"}]},
                "decode": {"instances": [{"url": "http://127.0.0.1:9"}]},
            }
        },
        "health": {"enabled": False},
        "auth": {"admin_key_env": "KVGUARD_TEST_ADMIN_KEY"},
    }
    async with running_proxy(config) as proxy:
        url = proxy.url + "/status"
        status, body = await get_text(url)
        assert status == 401 and "admin key" in body
        basic = base64.b64encode(b"anyone:s3cret").decode()
        wrong = base64.b64encode(b"anyone:nope").decode()
        for refused in (f"Basic {wrong}", "Basic !not-base64!", "Basic"):
            assert (await get_text(url, headers={"Authorization": refused}))[0] == 401
        for auth in ("Bearer s3cret", f"Basic {basic}"):
            status, body = await get_text(
                url + "?refresh=0", headers={"Authorization": auth}
            )
            assert status == 200 and "<h1>KVGuard proxy</h1>" in body
            assert 'http-equiv="refresh"' not in body
            assert "http://127.0.0.1:9" in body


async def test_status_page_is_open_without_an_admin_key():
    config = {
        "models": {
            "m": {
                "prefill": {"instances": [{"url": "http://127.0.0.1:9"}]},
                "decode": {"instances": [{"url": "http://127.0.0.1:9"}]},
            }
        },
        "health": {"enabled": False},
    }
    async with running_proxy(config) as proxy:
        status, body = await get_text(proxy.url + "/status")
    assert status == 200
    assert '<meta http-equiv="refresh" content="5">' in body
    assert "No KV integrity failure yet." in body


async def test_status_page_says_why_an_instance_is_out_and_whether_the_proxy_serves():
    config = {
        "models": {
            "m": {
                "prefill": {
                    "instances": [{"url": "http://p1:8100"}, {"url": "http://p2:8100"}]
                },
                "decode": {"instances": [{"url": "http://d:8200"}]},
            }
        },
        "health": {"enabled": False},
    }
    async with running_proxy(config) as proxy:
        p1, p2, d = proxy.state.all_instances()
        status, body = await get_text(proxy.url + "/status")
        assert status == 200 and '<span class="badge ok">serving</span>' in body
        # Ejected for 30 s with no failure counted here (another proxy's
        # verdict, or counts since reset): the page says so and flags its row.
        p1.ejected_until = time.monotonic() + 30.5
        d.healthy = False
        status, body = await get_text(proxy.url + "/status")
    page = _Rows()
    page.feed(body)
    states = {a["data-url"]: a["data-state"] for tag, a in page.tagged if tag == "tr"}
    assert states == {p1.url: "ejected", p2.url: "in-rotation", d.url: "unhealthy"}
    assert re.search(r"ejected \((30|29)s left\)", body)
    headers = {
        a["data-prefill"]: a["class"] for _, a in page.tagged if "data-prefill" in a
    }
    assert headers == {p1.url: "bad", p2.url: ""}
    assert '<span class="badge bad">model m: no healthy decode instance</span>' in body

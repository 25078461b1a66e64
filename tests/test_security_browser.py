"""A web page on another origin, in a real browser, cannot use the open local API (issue 12, bullet 3).

Headless Chromium (Debian's, driven by Playwright as in test_dashboard_browser.py) loads an attacker's page
from another local port. The page tries what the issue reproduced on b705dec, where each one ran a command:
``fetch`` with ``mode: "no-cors"`` and a ``text/plain`` YAML body, and an auto-submitted HTML form
(``enctype="text/plain"``). A third page is reached under a rebound DNS name (Chromium maps
``rebind.test`` to 127.0.0.1, so the page and the API share an origin to the browser: DNS rebinding).
Nothing reaches the log; the API's own request metrics show each attempt arrived and was refused, so the
test cannot pass because the page failed to send. The dashboard, on the API's own origin, still submits.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import playwright.sync_api as playwright_api
import pytest

from dagfold import metrics
from tests.api_support import ApiHarness, LiveServer, free_port
from tests.test_dashboard_browser import CHROMIUM_ARGS, chromium

SHELL_YAML = "tasks: [{id: pwn, handler: shell, args: {cmd: id}}]"


def attacker_page(api: str) -> str:
    form_body = SHELL_YAML.replace('"', "&quot;")
    return f"""<!doctype html><html><body>
<form id="f" method="POST" action="{api}/v1/jobs" enctype="text/plain" target="sink">
  <input type="hidden" name="{form_body}" value="">
</form>
<iframe name="sink"></iframe>
<script>
window.results = [];
fetch("{api}/v1/jobs", {{method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}},
                         body: {SHELL_YAML!r}}})
  .then(r => window.results.push("fetch:" + r.type), e => window.results.push("fetch-error:" + e));
fetch("{api}/v1/jobs", {{method: "POST", mode: "no-cors", body: new Blob([{SHELL_YAML!r}])}})
  .then(r => window.results.push("blob:" + r.type), e => window.results.push("blob-error:" + e));
document.getElementById("f").submit();
</script></body></html>"""


class AttackerSite:
    """A static page on its own loopback port: another origin than the API's."""

    def __init__(self, html: str) -> None:
        body = html.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                self.send_response(200)
                self.send_header("content-type", "text/html")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def refused() -> float:
    """Requests the API answered 403 or 415 so far (the guard's refusals are counted as route 'unmatched')."""
    total = 0.0
    for fam in metrics.API_REQUESTS.collect():
        for s in fam.samples:
            if s.name.endswith("_total") and s.labels.get("status") in ("403", "415"):
                total += s.value
    return total


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(),
                              args=[*CHROMIUM_ARGS, "--host-resolver-rules=MAP rebind.test 127.0.0.1"])
        yield b
        b.close()


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[ApiHarness, LiveServer]]:
    a = ApiHarness(tmp_path)
    with LiveServer(a.app) as srv:
        yield a, srv
    a.close()


def test_a_page_on_another_origin_cannot_submit(browser: Any, api: tuple[ApiHarness, LiveServer]) -> None:
    harness, srv = api
    site = AttackerSite(attacker_page(srv.url))
    before = refused()
    page = browser.new_page()
    try:
        page.goto(site.url)
        page.wait_for_function("window.results.length >= 2", timeout=15_000)
        page.wait_for_timeout(500)  # the form's navigation of the frame
        assert sorted(page.evaluate("window.results")) == ["blob:opaque", "fetch:opaque"]
    finally:
        page.close()
        site.close()
    assert harness.commands() == []  # nothing reached the log
    assert refused() - before >= 3  # the two fetches and the form arrived, and were refused


def test_a_rebound_dns_name_gets_nothing(browser: Any, api: tuple[ApiHarness, LiveServer]) -> None:
    harness, srv = api
    page = browser.new_page()
    try:
        answer = page.goto(f"http://rebind.test:{srv.port}/v1/jobs")
        assert answer is not None and answer.status == 403
        status = page.evaluate("""async () => (await fetch("/v1/jobs", {method: "POST",
            headers: {"Content-Type": "application/json"}, body: '{"tasks": [{"id": "a"}]}'})).status""")
        assert status == 403
    finally:
        page.close()
    assert harness.commands() == []


def test_the_dashboard_on_its_own_origin_still_submits(browser: Any, api: tuple[ApiHarness, LiveServer]) -> None:
    harness, srv = api
    page = browser.new_page()
    try:
        page.goto(f"{srv.url}/ui/")
        status = page.evaluate("""async () => (await fetch("/v1/jobs", {method: "POST",
            headers: {"Content-Type": "application/json"}, body: '{"tasks": [{"id": "a"}]}'})).status""")
        assert status == 202
    finally:
        page.close()
    assert [c["type"] for c in harness.commands()] == ["dagfold.command.SubmitJob"]

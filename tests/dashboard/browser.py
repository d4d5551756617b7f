"""A real headless browser for the dashboard tests: Debian's Chromium driven by Playwright.

Playwright never downloads a browser here: it launches ``/usr/bin/chromium``, which
``ensure_chromium`` installs from Debian's archive when the machine lacks it. Without the
background-networking flags Chromium opens connections of its own at start-up, which a closed
network refuses.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def ensure_chromium() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
        if result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
            )
    return CHROMIUM


class WatchedPage:
    """A page whose console errors and uncaught exceptions are kept, so that a test can say
    every page it opened was free of them. Dialogs (the actions' confirmations) are accepted."""

    def __init__(self, page, screenshots: Path):
        self.page = page
        self.screenshots = screenshots
        self.errors: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.errors.append(f"{page.url}: {error}"))
        page.on("dialog", lambda dialog: dialog.accept())
        page.set_default_timeout(20_000)

    def _console(self, message) -> None:
        if message.type == "error":
            self.errors.append(f"{self.page.url}: {message.text}")

    def screenshot(self, name: str) -> Path:
        path = self.screenshots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def log_in(self, base_url: str, username: str, password: str, then: str = "/") -> None:
        self.page.goto(f"{base_url}{then}")
        self.page.fill("#id_username", username)
        self.page.fill("#id_password", password)
        self.page.click('input[type="submit"]')
        self.page.wait_for_url(f"{base_url}{then}")


@contextmanager
def chromium_page(screenshots: Path):
    """One browser, one page; the browser is gone when the block ends.

    Playwright's synchronous API keeps an event loop registered on this thread while it runs,
    which Django takes for an async context: tests read the database before and after this
    block, and through the HTTP API inside it.
    """
    from playwright.sync_api import sync_playwright

    executable = ensure_chromium()
    screenshots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(executable), headless=True, args=CHROMIUM_FLAGS
        )
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            yield WatchedPage(context.new_page(), screenshots)
        finally:
            browser.close()

"""The console in a real headless browser: Debian's chromium (/usr/bin/chromium, never a
downloaded one) driven by Playwright against a live daemon: log in, find a session by
its title, open its transcript, pause a schedule, delete a session (through the confirm
dialog), with screenshots kept as the test's artifacts in `test-artifacts/console/` at
the repository's root (gitignored; `HERMES_TEST_ARTIFACTS` names another directory;
their paths are printed), where a passing run's tmp dir is removed."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.console_support import SEEDED, TOKEN, Daemon, start_daemon, stop_daemon

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(
    os.environ.get(
        "HERMES_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"
    )
)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    if not CHROMIUM.exists():
        print(f"skipped: {CHROMIUM} is absent (apt-get install -y chromium)")
        pytest.skip(f"{CHROMIUM} is absent: apt-get install -y chromium")
    procs: list[subprocess.Popen[str]] = []
    try:
        running = start_daemon(tmp_path / "home", procs)
        yield running
        stop_daemon(running)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.mark.timeout(180)
def test_an_operator_logs_in_finds_a_session_pauses_a_schedule_and_deletes_a_session(
    daemon: Daemon, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    (schedule_id,) = daemon.schedule_ids()
    shots = ARTIFACTS / "console"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"]
        )
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 800})
            page.goto(daemon.url + "/console/")
            expect(page).to_have_url(daemon.url + "/console/login")
            page.fill("input[name=token]", TOKEN)
            page.click("button[type=submit]")
            expect(page.locator("h1")).to_have_text("Overview")
            expect(page.locator("#live")).to_contain_text("Adapters")
            page.screenshot(path=shots / "overview.png", full_page=True)

            page.goto(daemon.url + "/console/sessions?q=" + "zebra report")
            titles = page.locator("a.title")
            expect(titles).to_have_count(1)
            titles.click()
            expect(page.locator("h1")).to_have_text(SEEDED["c-zebra"])
            expect(page.locator(".transcript")).to_contain_text("echo: Quarterly zebra report")

            page.click("nav >> text=Schedules")
            row = page.locator("tr", has_text=schedule_id)
            row.locator("button", has_text="Pause").click()
            expect(page.locator(".notice")).to_have_text(f"Paused {schedule_id}.")
            expect(row.locator(".status")).to_have_text("paused")

            page.goto(daemon.url + "/console/sessions?q=lisbon")
            page.locator("a.title").click()
            asked: list[str] = []
            page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
            page.click("button:has-text('Delete session')")
            expect(page).to_have_url(daemon.url + "/console/sessions")
            expect(page.locator(".notice")).to_contain_text("Deleted session")
            assert asked and "Trip to Lisbon" in asked[0]
            expect(page.locator("a.title", has_text="Lisbon")).to_have_count(0)

            phone = browser.new_page(viewport={"width": 390, "height": 844})
            phone.context.add_cookies(page.context.cookies())
            phone.goto(daemon.url + "/console/sessions")
            width = phone.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, f"the sessions page is {width} px wide at phone width"
            phone.screenshot(path=shots / "sessions-phone.png", full_page=True)
        finally:
            browser.close()
    print(f"screenshots: {shots}")
    for shot in sorted(shots.iterdir()):
        print(f"  {shot}")

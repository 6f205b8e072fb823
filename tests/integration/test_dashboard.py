"""The dashboard at /ui in Debian's headless chromium (driven by selenium through the
system's chromedriver; no browser is downloaded): `cpn serve` with three agents and a
running job; the page shows the sites, the measured links and the job, and its loss
chart gains points as the job trains. A screenshot is saved beside the test's files."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from api.routes.ui import UPLOT
from tests.processes import wait_until
from tests.service_harness import Cluster, cluster, make_key, tiny_job

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    assert CHROMIUM and CHROMEDRIVER, "scripts/setup.sh installs chromium and chromium-driver"
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1300"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


# The page redraws its tables and charts every refresh, so an element found by one
# WebDriver call can be gone by the next (StaleElementReferenceException under load).
# Each helper reads what it needs in one script, which runs between two redraws.
def _texts(driver: WebDriver, css: str) -> list[str]:
    script = "return Array.from(document.querySelectorAll(arguments[0]), e => e.innerText)"
    return list(driver.execute_script(script, css))


def _attrs(driver: WebDriver, css: str, name: str) -> set[str]:
    script = (
        "return Array.from(document.querySelectorAll(arguments[0]),"
        " e => e.getAttribute(arguments[1]))"
    )
    return {a for a in driver.execute_script(script, css, name) if a is not None}


def _points(driver: WebDriver, chart: str) -> int:
    found = _attrs(driver, f"#{chart}", "data-points")
    return int(found.pop()) if found else 0


@pytest.fixture(scope="module")
def three_sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("ui"), {"a": 2, "b": 1, "c": 1}) as c:
        yield c


def test_the_page_needs_nothing_from_elsewhere(three_sites: Cluster) -> None:
    assert UPLOT.exists(), "scripts/setup.sh vendors uPlot from npm into api/ui/vendor/"
    url = three_sites.url
    page = httpx.get(f"{url}/ui").text
    for ref in ("/ui/static/app.js", "/ui/static/style.css", "/ui/static/vendor/uPlot.iife.min.js"):
        assert ref in page
        assert httpx.get(f"{url}{ref}").status_code == 200
    assert "http://" not in page and "https://" not in page
    script = httpx.get(f"{url}/ui/static/app.js").text
    assert "innerHTML" not in script  # server values go in as text, never as markup


def test_dashboard_shows_sites_links_and_a_live_loss_chart(
    three_sites: Cluster, tmp_path: Path, browser: WebDriver
) -> None:
    c = three_sites
    key = make_key(c.db_url, "viewer")
    client = c.client(key)
    job = client.submit(tiny_job("dash", dp=2, pp=2, steps=100_000))
    queued_id = None
    try:
        wait_until(lambda: client.job(job.id).state.value == "running", 120, "the job to run")
        browser.get(f"{c.url}/ui#key={key}")
        wait_until(lambda: len(_texts(browser, "#sites tbody tr")) == 3, 30, "three sites")
        sites = _attrs(browser, "#sites tr[data-site]", "data-site")
        assert sites == {"a", "b", "c"}
        links = _attrs(browser, "#links tr[data-link]", "data-link")
        # One row per measured direction (uplinks are often asymmetric), every pair shown.
        assert links <= {f"{x} → {y}" for x in "abc" for y in "abc" if x != y}, links
        assert {frozenset(link.split(" → ")) for link in links} == {
            frozenset("ab"),
            frozenset("ac"),
            frozenset("bc"),
        }
        assert all("Mbit/s" in t for t in _texts(browser, "#links tbody tr"))
        running = f'#jobs tr[data-job="{job.id}"][data-state="running"]'
        wait_until(lambda: _texts(browser, running), 30, "the running job in the jobs table")
        (row,) = _texts(browser, f'#jobs tr[data-job="{job.id}"]')
        assert "a: 2 GPUs" in row and "b: 1 GPU" in row and "c: 1 GPU" in row, row
        # The loss chart is drawn (a uPlot canvas) and gains points as the job trains.
        first = wait_until(lambda: _points(browser, "loss-chart"), 60, "loss points")
        wait_until(lambda: _points(browser, "loss-chart") > first + 2, 60, "the chart to update")
        assert _texts(browser, "#loss-chart canvas")
        assert _points(browser, "wan-chart") > 0
        assert "job_state" in _attrs(browser, "#events li", "data-kind")
        assert not browser.find_element(By.ID, "error").is_displayed()
        # A newer job waiting for GPUs: the panel still shows the running one (the list is
        # newest first; it once showed the first job that was running *or* pending).
        queued_id = client.submit(tiny_job("dash-queued", dp=2, pp=2, steps=10)).id
        waiting = f'#jobs tr[data-job="{queued_id}"][data-state="pending"]'
        wait_until(lambda: _texts(browser, waiting), 30, "the queued job in the jobs table")
        time.sleep(2.5)  # a refresh with both jobs listed
        assert _texts(browser, "#job-id") == [job.id]
        time.sleep(2.5)  # one more refresh, so the screenshot shows a moving job
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        # A rejected key clears the jobs and says so; a malformed key in the address is
        # ignored (it once threw before the first refresh and left the page empty).
        browser.get(f"{c.url}/ui#key=not-a-key")
        wait_until(
            lambda: "rejected" in " ".join(_texts(browser, "#jobs-need-key")), 30, "rejection"
        )
        assert not _texts(browser, "#jobs tbody tr")
        assert not browser.find_element(By.ID, "job-detail").is_displayed()
        browser.get(f"{c.url}/ui#key=%E0%A4%A")
        wait_until(lambda: len(_texts(browser, "#sites tbody tr")) == 3, 30, "sites, bad key")
    finally:
        client.cancel(job.id)
        if queued_id is not None:
            client.cancel(queued_id)

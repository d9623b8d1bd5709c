"""A page opened in a real headless browser (Debian's Chromium through Selenium's ChromeDriver;
`scripts/test.sh` installs both): what a person would see of it."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# as Chromium runs on a machine without network: no background connections, no sandbox (root in CI)
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1200,900")
# the rendered facts a test reads, in one script run in the page
READ_PAGE = """
const visible = el => { const r = el.getBoundingClientRect(); const s = getComputedStyle(el);
  return r.width > 0 && r.height > 0 && s.visibility !== 'hidden' && s.display !== 'none'; };
const box = el => { const r = el.getBoundingClientRect(); return [r.left, r.right]; };
return {
  title: document.title,
  headings: [...document.querySelectorAll('h2')].filter(visible).map(h => h.textContent),
  verdict: [...document.querySelectorAll('.verdict')].filter(visible).map(p => p.textContent),
  charts: [...document.querySelectorAll('h2')].map(h => {
    let el = h.nextElementSibling; while (el && el.tagName !== 'svg' && el.tagName !== 'H2') el = el.nextElementSibling;
    if (!el || el.tagName !== 'svg') return [h.textContent, null];
    return [h.textContent, {visible: visible(el), box: box(el), bars: [...el.querySelectorAll('rect')].map(box),
                            texts: [...el.querySelectorAll('text')].map(t => t.textContent)}];
  }),
};
"""


@dataclass
class RenderedPage:
    title: str
    headings: list[str]
    verdict: list[str]  # the visible bottleneck sentences
    charts: dict[str, dict | None]  # section heading -> its first chart: visible, box [left, right] px, bars, texts
    errors: list[str]  # the browser console's errors and the page's script errors


def open_page(path: Path) -> RenderedPage:
    """Load `path` in headless Chromium and read it as rendered; AssertionError names what is missing
    when the browser is not installed."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if shutil.which(p) is None]
    assert not missing, f"{missing} not installed: scripts/test.sh installs Debian's chromium and chromium-driver"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(30)
        driver.set_script_timeout(30)
        driver.get(path.resolve().as_uri())
        facts = driver.execute_script(READ_PAGE)
        errors = [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    finally:
        driver.quit()
    return RenderedPage(facts["title"], facts["headings"], facts["verdict"], dict(facts["charts"]), errors)

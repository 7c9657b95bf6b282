"""The chat page in a real headless browser: Chromium (Debian's package, apt-installed when root) loads /, a
message is typed and sent, and the reply streams into the page. Slow: run by `make test` (its system-test step)
and `make test-all`; skipped with the reason where Chromium cannot be had."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import system_packages
from test_serve import Server, tiny_model

pytestmark = pytest.mark.skipif(os.environ.get("DORMOUSE_SLOW_TESTS") != "1",
                                reason="slow; set DORMOUSE_SLOW_TESTS=1 (make test's system step, make test-all)")


@pytest.fixture(scope="module")
def browser():
    why = system_packages.find_or_install(("chromium", "chromedriver"), ("chromium", "chromium-driver"))
    if why:
        pytest.skip(f"no headless Chromium: {why}")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = system_packages.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(system_packages.which("chromedriver")))
    yield driver
    driver.quit()


def test_the_chat_page_streams_a_reply_into_the_page(browser):
    from selenium.webdriver.common.by import By

    server = Server(tiny_model())
    try:
        browser.get(server.url + "/")
        assert "dormouse-test" in browser.title
        temperature = browser.find_element(By.ID, "temperature")
        temperature.clear()
        temperature.send_keys("0")  # greedy: the reply can be checked against the API's
        browser.find_element(By.ID, "input").send_keys("hello there")
        browser.find_element(By.ID, "send").click()
        deadline = time.monotonic() + 60
        while not browser.find_elements(By.CSS_SELECTOR, "#reply-1[data-finished='1']"):
            assert time.monotonic() < deadline, browser.page_source[-2000:]
            time.sleep(0.1)
        shown = browser.execute_script("return document.getElementById('reply-1').textContent")
        assert browser.execute_script("return document.getElementById('reply-1').dataset.done") == "1"  # [DONE] read
        want = httpx.post(server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello there"}], "temperature": 0, "max_tokens": 256}).json()
        assert shown == want["choices"][0]["message"]["content"] and shown
        assert server.health()["counters"]["serve.streams"] == 2
        user = browser.find_element(By.CSS_SELECTOR, ".msg.user").get_attribute("textContent")
        assert user == "hello there"
    finally:
        server.close()


def test_the_page_asks_for_the_api_key_and_a_page_elsewhere_cannot_post(browser):
    """With --api-key the chat page asks for the key (a prompt) and sends it; a page on another origin (here the
    same server reached as localhost, a different origin from 127.0.0.1) posting a "simple" text/plain request is
    refused before anything decodes."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    server = Server(tiny_model(), api_key="sekret", allowed_hosts=["localhost", "127.0.0.1", "::1"])
    try:
        browser.get(server.url + "/")
        browser.find_element(By.ID, "input").send_keys("hello there")
        browser.find_element(By.ID, "send").click()
        alert = WebDriverWait(browser, 30).until(expected_conditions.alert_is_present())
        assert "API key" in alert.text
        alert.send_keys("sekret")
        alert.accept()
        deadline = time.monotonic() + 60
        while not browser.find_elements(By.CSS_SELECTOR, "#reply-1[data-finished='1']"):
            assert time.monotonic() < deadline, browser.page_source[-2000:]
            time.sleep(0.1)
        assert browser.execute_script("return document.getElementById('reply-1').dataset.done") == "1"
        assert browser.execute_script("return document.getElementById('reply-1').textContent")
        assert server.health()["counters"]["serve.streams"] == 1
        browser.get(server.url.replace("127.0.0.1", "localhost") + "/")  # another origin
        sent = browser.execute_async_script("""
            const done = arguments[arguments.length - 1];
            fetch(arguments[0] + "/v1/chat/completions", {method: "POST", mode: "no-cors",
                  headers: {"Content-Type": "text/plain"},
                  body: JSON.stringify({messages: [{role: "user", content: "spend their GPU"}]})})
              .then(() => done("sent"), e => done(String(e)));""", server.url)
        assert sent == "sent"  # the browser sent it (no preflight for a simple request): the server must refuse it
        counters = server.health()["counters"]
        assert counters["serve.streams"] == 1 and counters["serve.rejected.cross_origin"] == 1, counters
    finally:
        server.close()

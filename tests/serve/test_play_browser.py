"""The live page (`wan_tpu/serve/static/`) in headless Chromium driven by Selenium, on the `matrix-game-tiny`
preset served by uvicorn with one stream at a time.

Reference: the uint8 frames the server made and sent (recorded by `play_routes(on_chunk=...)` as each
chunk is made; the page shows them as JPEG, which is lossy, so the comparison is made on the server's
frames, not on the canvas) equal, bit for bit, those of `pipe.stream(image, seed).step(keyboard, mouse)`
through the Python API with the same per-chunk actions; the chunk made once W is held differs from the
one made without it. The canvas itself is checked for frames arriving and changing, its size, and a
screenshot that is not blank. The page starts streams in the default mode (an action change drops the
frames queued before it); `?smooth=1` ticks its "smooth" box, and the server confirms that mode. A page
closed or left for another frees the one place at once.
"""

import base64
import io
import shutil
import time

import numpy as np
import pytest
from PIL import Image
from play_support import IMAGE, example_image

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e .[test])")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="chromium and chromium-driver are not installed "
                                                                    "(apt-get install -y chromium chromium-driver)")


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1200,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def wait(browser, condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}; the page shows {page_state(browser)}"
        time.sleep(0.05)


def text(browser, element_id: str) -> str:
    return browser.find_element("id", element_id).text


def page_state(browser) -> str:
    """The page's status line, frame count and console messages: what a timed-out wait saw."""
    try:
        console = [entry["message"] for entry in browser.get_log("browser")]
        return f"status {text(browser, 'status')!r}, frames {text(browser, 'frames')!r}, console {console}"
    except Exception as e:  # noqa: BLE001 - the timeout is the failure to report, not this
        return f"nothing readable ({type(e).__name__})"


def frames_shown(browser) -> int:
    shown = text(browser, "frames")
    return int(shown) if shown.isdigit() else 0


def canvas_pixels(browser) -> np.ndarray:
    url = browser.execute_script("return document.getElementById('screen').toDataURL('image/png')")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


def test_the_page_plays_and_a_key_changes_the_next_chunk(play_server, browser, play_pipe, play_chunks):
    from selenium.webdriver.common.action_chains import ActionChains

    play_chunks.clear()
    browser.get(f"{play_server}/play?example={IMAGE}&seed=0&fps=30")
    wait(browser, lambda: frames_shown(browser) >= 5, 240, "the first frames on the canvas")
    assert "matrix-game-tiny" in text(browser, "variant") and "W" in text(browser, "keys")
    assert text(browser, "status") == "playing: seed 0, 30 fps"  # the server's `started`: not smooth
    assert not browser.find_element("id", "smooth").is_selected()
    canvas = browser.find_element("id", "screen")
    h, w = play_pipe.size
    assert (int(canvas.get_attribute("width")), int(canvas.get_attribute("height"))) == (w, h)
    before = canvas_pixels(browser)
    wait(browser, lambda: frames_shown(browser) >= 15, 60, "more frames")
    assert not np.array_equal(canvas_pixels(browser), before)  # the picture moves

    canvas.click()
    held = len(play_chunks)
    ActionChains(browser).key_down("w").perform()
    wait(browser, lambda: any(k[0] == 1 for _, _, k, _ in play_chunks[held:]), 30, "a chunk made with W held")
    ActionChains(browser).key_up("w").perform()
    wait(browser, lambda: play_chunks[-1][2][0] == 0, 30, "a chunk made after W was released")
    assert text(browser, "latency").endswith("ms")
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []  # no script error, no failed request

    screenshot = np.asarray(Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB"))
    assert screenshot.shape[0] >= 600 and screenshot.std() > 10  # the page is drawn, not blank
    box = canvas.rect
    shot = screenshot[int(box["y"]) : int(box["y"] + box["height"]), int(box["x"]) : int(box["x"] + box["width"])]
    assert box["width"] >= 2 * w and shot.std() > 5  # the canvas, scaled up, shows a picture

    recorded = list(play_chunks)
    assert [c for c, *_ in recorded] == list(range(len(recorded)))
    session = play_pipe.stream(example_image(), seed=0)
    first_w = next(i for i, (_, _, k, _) in enumerate(recorded) if k[0] == 1)
    for chunk, frames, keyboard, mouse in recorded:
        if chunk == first_w:
            without = play_pipe.stream(example_image(), seed=0)
            for _, _, k, m in recorded[:first_w]:
                without.step(k, m)
            assert not np.array_equal(without.step(*play_pipe.action_row([])), frames)  # W changed this chunk
        np.testing.assert_array_equal(frames, session.step(keyboard, mouse))


def test_another_tab_waits_and_a_closed_tab_frees_its_place(play_server, browser):
    browser.get(f"{play_server}/play?fps=30")
    wait(browser, lambda: frames_shown(browser) >= 1, 120, "frames in the first tab")
    first = browser.current_window_handle
    browser.switch_to.new_window("tab")
    browser.get(f"{play_server}/play?example=snow&fps=30&smooth=1")
    wait(browser, lambda: text(browser, "status").startswith("waiting: 1 sessions in use"), 30, "the waiting message")
    assert browser.find_element("id", "smooth").is_selected()  # set from the query once the server said hello
    assert frames_shown(browser) == 0
    waiting = browser.current_window_handle
    browser.switch_to.window(first)
    browser.close()
    browser.switch_to.window(waiting)
    wait(browser, lambda: frames_shown(browser) >= 3, 60, "frames in the tab that waited")
    assert text(browser, "status") == "playing: seed 0, 30 fps, smooth"


def test_a_page_left_for_another_frees_its_place_and_plays_again_when_brought_back(play_server, browser):
    """Chromium keeps a page left for another, frozen, in its back/forward cache, its socket open unless the
    page closes it; at 2 fps its stream would then hold the one place for minutes (until the stream's end
    or the cache's eviction) and the page in another tab would wait in line."""
    browser.get(f"{play_server}/play?fps=2")
    wait(browser, lambda: frames_shown(browser) >= 1, 120, "frames in the page")
    browser.get(f"{play_server}/play/examples")
    left = browser.current_window_handle
    browser.switch_to.new_window("tab")
    browser.get(f"{play_server}/play?example=snow&fps=30")
    wait(browser, lambda: frames_shown(browser) >= 1, 30, "frames in another tab once the page was left")
    browser.close()
    browser.switch_to.window(left)
    browser.back()  # from the cache: the page's socket is closed, so it starts afresh
    wait(browser, lambda: text(browser, "status") == "playing: seed 0, 2 fps" and frames_shown(browser) >= 1, 60,
         "frames in the page brought back")

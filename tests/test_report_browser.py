"""The report in a real browser: Debian's headless Chromium (`make browser` installs it), driven
by playwright, opens report.html from a real tool-calling run. The page renders (screenshots are
not blank, every plot image decodes), the viewer lists the expected trajectories, its filters
change the list, and a trajectory shows its turns with model and tool tokens shaded by
response_mask and each model token's logprob."""

from __future__ import annotations

import io
import math
import shutil
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from generation_core.report.html import REPORT_FILE, write_report
from generation_core.store.folder import StorageFolder
from tests.report_runs import COMMITTED, ROWS, committed_records, tool_run

pytestmark = pytest.mark.timeout(300)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir):
    """The tool run's folder with its full report, and a copy whose viewer holds 3 trajectories."""
    directory = tmp_path_factory.mktemp("report-browser")
    tool_run(directory, model_dir)
    full, capped = directory / "run", directory / "capped"
    shutil.copytree(full, capped)
    write_report(StorageFolder(str(full)))
    write_report(StorageFolder(str(capped)), sample_size=3)
    return full, capped


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM.exists(), (
        f"{CHROMIUM} is missing: `make browser` installs Debian's chromium (make test does it first)"
    )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def open_report(browser):
    pages, errors = [], []

    def open_(folder: Path):
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.route("**/*", lambda route: refuse_off_page(route, errors))
        page.goto((folder / REPORT_FILE).as_uri())
        page.wait_for_selector(".traj-row")
        pages.append(page)
        return page

    yield open_
    for page in pages:
        page.close()
    assert errors == [], "no script error, no request off the page"


def refuse_off_page(route, errors: list) -> None:
    """Nothing may leave the page: every request but the file itself is refused and recorded."""
    if route.request.url.startswith("file://"):
        route.continue_()
    else:
        errors.append(f"request off the page: {route.request.url}")
        route.abort()


def not_blank(png: bytes) -> float:
    """The standard deviation of the screenshot's grey levels (0 for a blank page)."""
    return ImageStat.Stat(Image.open(io.BytesIO(png)).convert("L")).stddev[0]


def shown(page) -> list[str]:
    return page.locator(".traj-row").evaluate_all("rows => rows.map(row => row.dataset.id)")


def test_the_page_renders_its_plots_and_lists_every_trajectory(runs, open_report):
    full, _ = runs
    page = open_report(full)
    assert not_blank(page.screenshot(full_page=True)) > 20
    sizes = page.locator("figure img").evaluate_all(
        "images => images.map(image => [image.complete, image.naturalWidth, image.naturalHeight])"
    )
    assert sizes == [[True, 700, 360]] * 6, "five plots, and the time split in the Capacity section"
    assert page.locator("#shard-table tbody tr").count() == 2
    assert page.locator("#failure-table tbody tr").count() == 2
    records = committed_records(StorageFolder(str(full)))
    assert shown(page) == [f"{r.index}:{r.rollout_n}" for r in records]
    assert page.inner_text("#shown-count") == f"{COMMITTED} of {COMMITTED} shown"
    viewer = page.locator("#viewer")
    viewer.scroll_into_view_if_needed()
    assert not_blank(viewer.screenshot()) > 20


def test_filters_change_the_list(runs, open_report):
    full, _ = runs
    page = open_report(full)
    records = committed_records(StorageFolder(str(full)))

    def expect(predicate):
        ids = [f"{r.index}:{r.rollout_n}" for r in records if predicate(r)]
        assert shown(page) == ids
        assert page.inner_text("#shown-count") == f"{len(ids)} of {COMMITTED} shown"

    page.fill("#f-reward-min", "1")
    expect(lambda r: r.reward_score >= 1)
    page.select_option("#f-source", "test/puzzles")
    expect(lambda r: r.reward_score >= 1 and ROWS[r.index][1] == "test/puzzles")
    page.fill("#f-reward-min", "")
    expect(lambda r: ROWS[r.index][1] == "test/puzzles")
    page.select_option("#f-source", "")
    shortest = min(len(r.response_ids) for r in records)
    page.fill("#f-length-max", str(shortest))
    expect(lambda r: len(r.response_ids) <= shortest)
    assert 0 < len(shown(page)) < COMMITTED
    page.fill("#f-length-max", "")
    page.fill("#f-reward-max", "-1")
    expect(lambda r: False)
    assert page.inner_text("#traj-detail") == "No trajectory passes the filters."


def test_a_trajectory_shows_its_turns_mask_and_logprobs(runs, open_report, model_dir):
    from verl.utils import hf_tokenizer

    full, _ = runs
    page = open_report(full)
    record = next(r for r in committed_records(StorageFolder(str(full))) if (r.index, r.rollout_n) == (1, 1))
    page.click('.traj-row[data-id="1:1"]')
    assert page.locator(".traj-row.selected").evaluate_all("rows => rows.map(row => row.dataset.id)") == ["1:1"]
    assert page.locator("#traj-detail .turn").evaluate_all("turns => turns.map(turn => turn.className)") == [
        "turn prompt",
        "turn model",
        "turn tool",
        "turn model",
    ]
    mask = record.response_mask
    assert page.locator(".tok.model").count() == sum(mask)
    assert page.locator(".tok.tool").count() == len(mask) - sum(mask)
    tokens = page.locator(".tok").evaluate_all(
        "spans => spans.map(span => [span.textContent, span.className, span.dataset.logprob ?? null, getComputedStyle(span).backgroundColor])"
    )
    tokenizer = hf_tokenizer(str(model_dir))
    assert "".join(text for text, *_ in tokens) == tokenizer.decode(record.response_ids)
    assert page.locator(".turn.prompt pre").text_content() == tokenizer.decode(record.prompt_ids)
    for (_, css, logprob, colour), model, expected in zip(tokens, mask, record.response_logprobs, strict=True):
        if model:
            assert css == "tok model" and float(logprob) == pytest.approx(expected, abs=1e-3)
            # hsl(120 p, 75%, 80%): the colour follows the token's probability.
            hue = round(120 * math.exp(round(expected, 3)))
            probe = page.evaluate(
                "hue => { const s = document.createElement('span'); s.style.background = `hsl(${hue}, 75%, 80%)`; document.body.append(s); const c = getComputedStyle(s).backgroundColor; s.remove(); return c; }",
                hue,
            )
            assert colour == probe
        else:
            assert css == "tok tool" and logprob is None and colour == "rgb(226, 232, 240)"
    first = page.locator(".tok.model").first.get_attribute("title")
    assert first.startswith("#0 token ") and f"logprob {record.response_logprobs[0]:.3f}" in first


def test_the_viewer_sorts_by_a_timing_keeps_the_slowest_and_shows_the_time_split(runs, open_report):
    """Issue 35 item 5: sort by any timing (slowest first), "slowest 1%", the split per trajectory."""
    from generation_core.report.viewer import _timing_fields

    full, _ = runs
    page = open_report(full)
    records = committed_records(StorageFolder(str(full)))
    totals = {f"{r.index}:{r.rollout_n}": _timing_fields(r)["time"]["total"] for r in records}
    decode = {f"{r.index}:{r.rollout_n}": _timing_fields(r)["time"]["decode"] for r in records}
    page.select_option("#f-sort", "decode")
    assert shown(page) == sorted(decode, key=lambda key: -decode[key])
    page.select_option("#f-sort", "total")
    assert shown(page) == sorted(totals, key=lambda key: -totals[key])
    page.check("#f-slowest")
    slowest = max(totals.values())
    assert shown(page) == [key for key in sorted(totals, key=lambda key: -totals[key]) if totals[key] >= slowest]
    page.uncheck("#f-slowest")
    page.select_option("#f-sort", "")
    assert shown(page) == list(totals), "back to sample id order"
    page.click('.traj-row[data-id="1:1"]')
    split = page.inner_text("#traj-detail .time-split")
    assert all(
        label in split
        for label in ("slot wait:", "prefill:", "decode:", "tool calls:", "reward fn:", "total:", "replica(s):")
    )


def test_a_capped_viewer_says_how_many_of_how_many(runs, open_report):
    _, capped = runs
    page = open_report(capped)
    assert len(shown(page)) == 3
    assert page.inner_text("#shown-count") == "3 of 3 shown"
    assert page.inner_text("#viewer-sample").startswith(
        f"Showing 3 of {COMMITTED} trajectories: a uniform sample by sample id"
    )

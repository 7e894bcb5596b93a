"""The pages' layout in a real headless Chromium at a desktop's, a half screen's and a phone's width: no cell is
cut or overlaps another, icons are drawn without fonts, times read as times, a held record says what approving
sends."""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from playwright.sync_api import Browser, Page, expect

from tests.support.browser import Server, shot
from tests.support.pages import JOB, NODE, seeded

# Every cell of the history's rows, the record tables and the head row, and whether each overflows its box
# (text cut by an ellipsis or spilling over its neighbour) or overlaps another cell of its row.
MEASURE = """() => {
  const visible = e => e.getClientRects().length > 0 && getComputedStyle(e).visibility !== "hidden";
  const name = e => (e.closest("[id]") ? "#" + e.closest("[id]").id + " " : "") + e.tagName.toLowerCase() +
                    (e.className && typeof e.className === "string" ? "." + e.className.split(" ").join(".") : "");
  const problems = [];
  const cells = document.querySelectorAll(".records .row > *, td, th");
  for (const c of cells) {
    if (!visible(c)) continue;
    if (c.scrollWidth > c.clientWidth + 1)
      problems.push(`${name(c)} "${c.textContent.trim().slice(0, 40)}" is ${c.scrollWidth} px wide ` +
                    `in ${c.clientWidth} px`);
  }
  for (const row of document.querySelectorAll(".records .row")) {
    const boxes = Array.from(row.children).filter(visible).map(e => [e, e.getBoundingClientRect()])
      .filter(([, r]) => r.width > 0 && r.height > 0);
    for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
      const [a, ra] = boxes[i], [b, rb] = boxes[j];
      if (ra.left < rb.right - 1 && rb.left < ra.right - 1 && ra.top < rb.bottom - 1 && rb.top < ra.bottom - 1)
        problems.push(`"${a.textContent.trim().slice(0, 30)}" overlaps "${b.textContent.trim().slice(0, 30)}"`);
    }
  }
  const doc = document.documentElement;
  if (doc.scrollWidth > window.innerWidth + 1)
    problems.push(`the page is ${doc.scrollWidth} px wide in a ${window.innerWidth} px window`);
  return problems;
}"""

# Words of the params, results and status badges that the browser split between two letters or digits (a break
# after a hyphen or a colon, as in a long job name, is where a person would break it too).
SPLIT_WORDS = """() => {
  const split = [];
  const top = (node, i) => { const r = document.createRange(); r.setStart(node, i); r.setEnd(node, i + 1);
                             const rects = r.getClientRects(); return rects.length ? Math.round(rects[0].top) : null; };
  for (const block of document.querySelectorAll(".params, pre, .badge, .chip")) {
    const walker = document.createTreeWalker(block, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const text = node.textContent;
      for (const m of text.matchAll(/[^\\s]+/g)) {
        for (let i = m.index + 1; i < m.index + m[0].length; i++) {
          if (/\\w/.test(text[i - 1]) && /\\w/.test(text[i]) && top(node, i - 1) !== top(node, i)) {
            split.push(m[0]);
            break;
          }
        }
      }
    }
  }
  return split;
}"""


@pytest.fixture
def site(make_app: Any, r: redis.Redis, redis_url: str, tmp_path: Path) -> Iterator[tuple[Server, dict[str, str]]]:
    """The seeded history behind a real HTTP server."""
    with seeded(make_app, r, redis_url, tmp_path) as (app, ids):
        server = Server(app)
        yield server, ids
        server.stop()


def at(browser: Browser, width: int, console: list[str] | None = None) -> Page:
    """A page `width` px wide; what its console says goes to `console`."""
    page = browser.new_context(viewport={"width": width, "height": 1000}).new_page()
    if console is not None:
        page.on("console", lambda m: console.append(m.text))
    return page


def pages(server: Server, ids: dict[str, str]) -> dict[str, str]:
    """The history (every record opened), the record pages and a target's page, by name."""
    return {"history": server.url + "/", **{f"record-{k}": f"{server.url}/records/{ids[k]}"
                                          for k in ("effective", "partial", "held", "skipped", "checkpoint",
                                                    "checkpoint_job")},
            "target": f"{server.url}/targets/job/{JOB}"}


def problems_of(page: Page, url: str) -> list[str]:
    page.goto(url)
    page.evaluate("() => document.querySelectorAll('details').forEach(d => { d.open = true; })")
    return page.evaluate(MEASURE)


def test_no_cell_overflows_or_overlaps_another_at_800_px(site: tuple[Server, dict[str, str]],
                                                          browser: Browser) -> None:
    server, ids = site
    console: list[str] = []
    page = at(browser, 800, console)
    found = {name: problems_of(page, url) for name, url in pages(server, ids).items()}
    shot(page, "layout-800.png")
    assert {k: v for k, v in found.items() if v} == {}
    # Nothing of the layout needs an inline style or script the Content-Security-Policy refuses.
    assert not [m for m in console if "Content Security Policy" in m], console
    # Every record's target and actions are on the history at this width, not hidden with their columns.
    page.goto(server.url + "/")
    for rid, shown in ((ids["partial"], "reduce_batch_size"), (ids["dispatched"], "disk_cleanup")):
        summary = page.locator(f"#rec-{re.escape(rid)} > summary")
        expect(summary.locator(".c-target")).to_be_visible()
        expect(summary.locator(".c-actions")).to_contain_text(shown)
    expect(page.locator(f"#rec-{re.escape(ids['dispatched'])} > summary .c-target")).to_contain_text(NODE)
    page.context.close()


def test_the_pages_fit_a_desktop_and_a_phone_without_cut_text_or_sideways_scrolling(
        site: tuple[Server, dict[str, str]], browser: Browser) -> None:
    server, ids = site
    for width in (1280, 390):
        page = at(browser, width)
        found = {name: problems_of(page, url) for name, url in pages(server, ids).items()}
        assert {k: v for k, v in found.items() if v} == {}, f"at {width} px"
        page.goto(server.url + "/")
        expect(page.locator(f"#rec-{re.escape(ids['partial'])} > summary")).to_contain_text(JOB)
        shot(page, f"layout-{width}.png")
        page.context.close()


def test_the_record_page_reads_plainly(site: tuple[Server, dict[str, str]], browser: Browser) -> None:
    """No Python None, times as a person reads them, a resolved alert said so, params split only between words,
    status icons drawn as SVG rather than characters a font may lack."""
    server, ids = site
    page = at(browser, 800)
    for name, url in pages(server, ids).items():
        page.goto(url)
        page.evaluate("() => document.querySelectorAll('details').forEach(d => { d.open = true; })")
        text = page.locator("main").inner_text()
        assert not re.search(r"\bNone\b", text), name
        assert not re.search(r"\d\d:\d\d:\d\d\.\d{4,}", text), f"{name} shows a raw nanosecond time"
        assert not re.search(r"\d{4}-\d\d-\d\dT\d\d:", text), f"{name} shows an RFC 3339 time as it is stored"
        assert page.evaluate(SPLIT_WORDS) == [], f"{name} splits words of its params, results or badges"
        badges = page.locator(".badge, .chip")
        assert badges.count() > 0
        for b in badges.all():
            assert re.fullmatch(r"[\w .:-]+", b.inner_text().strip()), f"{name}: {b.inner_text()!r} is not words"
            assert b.locator("svg.ico").count() == 1, f"{name}: {b.inner_text()!r} has no drawn icon"
        sizes = page.locator("svg.ico").evaluate_all("els => els.map(e => e.getBoundingClientRect().height)")
        assert sizes and max(sizes) <= 20, f"{name} draws an icon {max(sizes)} px high"
    page.goto(pages(server, ids)["record-effective"])
    expect(page.locator("#record h3", has_text="Alert")).to_contain_text("resolved")
    expect(page.locator("#record h3", has_text="Alert")).not_to_contain_text("firing")
    page.context.close()


def test_a_held_record_shows_what_approving_sends_beside_the_buttons(site: tuple[Server, dict[str, str]],
                                                                     browser: Browser) -> None:
    server, ids = site
    page = at(browser, 800)
    page.goto(pages(server, ids)["record-held"])
    plan = page.locator(".approval .sends")
    expect(plan).to_contain_text(f"node {NODE}")
    expect(plan.locator("li")).to_have_count(1)
    expect(plan.locator("li")).to_contain_text("drain_node")
    sent = 'reason "GPU hardware error (XID 79, fallen off the bus) reported by DCGM on GPU 3"'
    expect(plan.locator("li")).to_contain_text(sent)  # the parameter whole, as JSON
    # The plan and the buttons sit together: the plan ends where the buttons begin, or just above them.
    box, buttons = plan.bounding_box(), page.locator(".decide").bounding_box()
    assert box is not None and buttons is not None and 0 <= buttons["y"] - (box["y"] + box["height"]) < 40
    expect(page.locator(".approval")).to_contain_text("has not checked in during the last minute")
    shot(page, "record-held.png")
    # A live target is asked nothing it cannot do without the page saying so beside that action.
    page.goto(f"{server.url}/records/{ids['held_live']}")
    steps = page.locator(".approval .sends li")
    expect(steps).to_have_count(2)
    expect(steps.nth(0).locator("code")).to_have_text("scale_lr")
    expect(steps.nth(0).locator(".params")).to_have_text("factor 0.5")
    expect(steps.nth(0).locator(".warn")).to_have_count(0)
    expect(steps.nth(1).locator(".warn")).to_contain_text("does not list save_checkpoint")
    expect(page.locator(".approval")).not_to_contain_text("has not checked in")
    page.context.close()


def test_a_node_record_links_each_jobs_checkpoint_and_the_job_links_back(site: tuple[Server, dict[str, str]],
                                                                          browser: Browser) -> None:
    server, ids = site
    page = at(browser, 390)
    page.goto(f"{server.url}/records/{ids['checkpoint']}")
    section = page.locator("#checkpoints")
    expect(section.locator(".waited")).to_contain_text("once every job on the node acknowledged its checkpoint")
    link = section.locator(f'a[href="/records/{ids["checkpoint_job"]}"]')
    expect(link).to_be_visible()
    expect(section.locator("li .chip")).to_contain_text("applied")
    shot(page, "record-checkpoint.png")
    link.click()
    expect(page).to_have_url(f"{server.url}/records/{ids['checkpoint_job']}")
    back = page.locator("#record tr", has_text="checkpoint for").locator("a")
    expect(back).to_have_attribute("href", f"/records/{ids['checkpoint']}")
    expect(page.locator("#ladder")).to_have_count(0)
    page.context.close()

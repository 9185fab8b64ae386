"""A real `kvtrace dashboard` process over a filled store, drawn by headless Chromium: the tiles
show what the verdict rows add up to, every axis plotly drew carries its title and unit, and the
empty states (events never judged; zero unsafe reuses) read as what they are. Screenshots go to
test-artifacts/ (or $KVTRACE_TEST_ARTIFACTS)."""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

import pytest
from dashboard_fill import DashboardProcess, Scenario, dom, filled, screenshot

ARTIFACTS = Path(os.environ.get("KVTRACE_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "test-artifacts"))

# page -> the axis titles its charts draw, in the order they are in the DOM
AXES = {
    "": ["time (UTC)", "share of prompt tokens (%)", "verdict", "lookups (count)"],
    "gaps": ["reason", "tokens lost (tokens)", "tokens to restore (tokens)", "tier the state is on",
             "bytes to move (GiB)"],
    "tiers": ["time (UTC)", "bytes (GiB)", "time (UTC)", "bytes (GiB)", "time (UTC)", "bytes resident (GiB)"],
    "timings": ["tier path", "transfer time (ms)", "tier", "time on tier before eviction (s)"],
    "preemption": ["instance (re-admissions)", "tokens on resume (tokens)"],
    "costs": ["context position: tokens before the span (bucket start)", "time per token (µs)",
              "context position (tokens cached before)", "smallest restore that pays (tokens)"],
}


def texts(page: str, css: str) -> list[str]:
    """The text of the SVG <text> elements plotly drew with this class (or inside a group of it)."""
    return [html.unescape(t) for t in re.findall(rf'<(?:text|g) class="{css}"[^>]*>(?:<text[^>]*>)?([^<]*)</text>',
                                                 page)]


def tiles(page: str) -> dict[str, tuple[str, str]]:
    """data-stat -> (css classes, shown text) of each headline tile."""
    return {stat: (css.strip(), html.unescape(text)) for css, stat, text in re.findall(
        r'<div class="tile ([^"]*)" data-stat="(\w+)" data-value="[^"]*"><div class="v">([^<]*)</div>', page)}


def draw(url: str, shot: Path) -> str:
    page, console = dom(url)
    assert not [line for line in console if "rror" in line or "Uncaught" in line], console
    assert 'data-ready="1"' in page, url
    screenshot(url, shot)
    assert shot.stat().st_size > 10_000, shot
    return page


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("dash-full")
    dsn, says = filled(root, Scenario.FULL)
    with DashboardProcess(root, dsn) as dash:
        yield dash, says


def test_tiles_show_what_the_store_says_and_every_axis_its_unit(full) -> None:
    dash, says = full
    for path, axes in AXES.items():
        page = draw(f"{dash.url}/{path}?range=all", ARTIFACTS / f"browser-{path or 'funnel'}.png")
        assert texts(page, "(?:x|y|y2)title") == axes, path
        shown = tiles(page)
        assert shown == {
            "logical_rate": ("", f"{says['logical_rate']:.1%}"),
            "recoverable_rate": ("", f"{says['recoverable_rate']:.1%}"),
            "adopted_rate": ("", f"{says['adopted_rate']:.1%}"),
            "tokens_lost": ("", f"{says['tokens_lost']:,}"),
            "unsafe_reuses": ("bad", f"{says['unsafe_reuses']:,}"),
            "readmissions": ("", f"{says['readmissions']:,}"),
        }, path
    funnel = draw(f"{dash.url}/?range=all", ARTIFACTS / "browser-funnel.png")
    # shares are percents on the axis, and every one of the five series is in the legend
    assert {"0%", "20%", "40%", "60%", "80%", "100%"} <= set(texts(funnel, "ytick"))
    assert texts(funnel, "legendtext") == ["logical (hash hit)", "recoverable (valid state)",
                                           "resident (no restore needed)", "adopted (engine reused)",
                                           "gap (logical - recoverable)"]
    # the verdict bars carry their counts and the new meanings
    bars = [html.unescape(t) for t in re.findall(r'<text class="bartext[^"]*"[^>]*>([^<]*)</text>', funnel)]
    assert bars == [str(says["verdicts"].get(v, 0)) for v in ("HIT", "PARTIAL", "MISS")]
    lines = re.findall(r'<tspan class="line"[^>]*>([^<]*)</tspan>', funnel)  # the verdicts' two-line ticks
    assert {"HIT", "PARTIAL", "MISS", "no hash hit", "the whole hash hit usable as is"} <= set(lines)


def test_events_never_judged_say_how_to_judge_them(tmp_path: Path) -> None:
    dsn, says = filled(tmp_path, Scenario.NO_VERDICTS)
    assert says["lookups"] == 0
    with DashboardProcess(tmp_path, dsn) as dash:
        page = draw(f"{dash.url}/?range=all", ARTIFACTS / "browser-no-verdicts.png")
    assert {stat: text for stat, (_, text) in tiles(page).items()} == dict.fromkeys(
        ("logical_rate", "recoverable_rate", "adopted_rate", "tokens_lost", "unsafe_reuses", "readmissions"), "n/a")
    why = re.search(r'<div class="empty" id="why-empty">(.*?)</div>', page, re.S)
    assert why and "kvtrace analyze --write-verdicts" in why.group(1) and "kvtrace collector" in why.group(1)
    sections = dict(re.findall(r'<section data-panel="(\w+)">(.*?)</section>', page, re.S))
    for key in ("funnel", "verdicts"):  # the cause is named once, above; each empty panel points to it
        assert "Nothing to draw, for the reason in the note above." in sections[key], key
        assert "No data" not in sections[key]


def test_zero_unsafe_reuses_read_as_none(tmp_path: Path) -> None:
    dsn, says = filled(tmp_path, Scenario.SAFE)
    assert says["unsafe_reuses"] == 0 and says["lookups"] == 80 and says["readmissions"] == 4
    with DashboardProcess(tmp_path, dsn) as dash:
        page = draw(f"{dash.url}/unsafe?range=all", ARTIFACTS / "browser-zero-unsafe.png")
    assert tiles(page)["unsafe_reuses"] == ("good", "none")
    sections = dict(re.findall(r'<section data-panel="(\w+)">(.*?)</section>', page, re.S))
    assert re.search(r'<div class="none" data-points="0"><b>None\.</b> No request adopted more than was '
                     r"recoverable in this range \(84 lookups judged\)\.</div>", sections["unsafe"])

"""The web dashboard's controls and states, over the embedded store: relative and ISO-8601 time
ranges (and a clear 400 for a bad one), which clock a relative range counts from, auto-refresh
kept in links, the app mounted under a prefix, and empty states that name their cause."""

from __future__ import annotations

import re
import time

import pytest
from dashboard_fill import ENGINES, replay, store_says
from fastapi import FastAPI
from starlette.testclient import TestClient

from kvtrace.dashboards.timerange import BadInput, Clock, parse_instant, resolve
from kvtrace.dashboards.web import PAGES, create_dashboard_app
from kvtrace.store.client import Store


def test_instants_read_iso_8601_and_unix_seconds() -> None:
    assert parse_instant("from", "1750000000") == 1750000000
    assert parse_instant("from", "1750000000.9") == 1750000000
    assert parse_instant("from", "2025-06-15T15:06:40Z") == 1750000000
    assert parse_instant("from", "2025-06-15T15:06:40") == 1750000000  # no zone: UTC
    assert parse_instant("from", "2025-06-15T17:06:40+02:00") == 1750000000
    assert parse_instant("from", "2025-06-15") == 1749945600
    with pytest.raises(BadInput, match=r"^to='yesterday' is neither an ISO-8601 time .* nor Unix seconds$"):
        parse_instant("to", "yesterday")


def test_relative_ranges_count_from_now_or_from_the_newest_event() -> None:
    now = 1_800_000_000
    live = resolve("1h", "", "", (now - 7200, now - 10), now)  # data up to 10 s ago: the wall clock
    assert (live.from_s, live.to_s, live.clock) == (now - 3600, now, Clock.WALL)
    old = resolve("1h", "", "", (1_750_000_000, 1_750_000_554), now)  # a replayed trace, a year old
    assert (old.from_s, old.to_s, old.clock) == (1_750_000_554 - 3600, 1_750_000_554, Clock.NEWEST_EVENT)
    assert "ending at the newest stored event" in old.describe(now)
    assert resolve("", "", "", (5, 9), now).clock is Clock.STORED
    assert (resolve("all", "", "", (5, 9), now).from_s, resolve("all", "", "", (5, 9), now).to_s) == (5, 9)
    fixed = resolve("", "1970-01-01T00:00:07Z", "", (5, 9), now)  # a missing bound is the store's
    assert (fixed.from_s, fixed.to_s, fixed.clock) == (7, 9, Clock.FIXED)
    assert resolve("15m", "1", "2", (5, 9), now).range_key == "15m"  # a named range wins over stale bounds
    for bad in (("2h", "", ""), ("", "9", "1")):
        with pytest.raises(BadInput):
            resolve(*bad, (5, 9), now)


@pytest.fixture
def filled(store: Store) -> Store:
    replay(store)
    return store


def test_iso_bounds_give_the_same_rows_as_unix_seconds_and_bad_ones_a_clear_400(filled: Store) -> None:
    client = TestClient(create_dashboard_app(filled))
    says = store_says(filled)
    lo, hi = says["lo"], says["hi"]
    iso = {"from": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(lo)),
           "to": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(hi))}
    assert (client.get("/api/panels/funnel", params=iso).json()
            == client.get("/api/panels/funnel", params={"from": lo, "to": hi}).json() != [])
    page = client.get("/", params={**iso, "model": "jamba"})
    assert page.status_code == 200 and "data-stat='logical_rate'" in page.text
    for params, message in (({"from": "last tuesday"}, "from=&#x27;last tuesday&#x27; is neither an ISO-8601 time"),
                            ({"to": "2025-13-45"}, "to=&#x27;2025-13-45&#x27; is neither an ISO-8601 time"),
                            ({"from": hi, "to": lo}, "is after to"),
                            ({"range": "2h"}, "range=&#x27;2h&#x27; is not one of 15m, 1h, 6h, 24h, 7d, all"),
                            ({"refresh": "5s"}, "refresh=&#x27;5s&#x27; is not one of off, 10s, 30s, 1m"),
                            ({"interval_s": "0"}, "interval_s=&#x27;0&#x27; is not a whole number of seconds")):
        for path in ("/", "/tiers"):
            bad = client.get(path, params=params)
            assert bad.status_code == 400 and "<h1>Bad request</h1>" in bad.text and message in bad.text, params
    api = client.get("/api/panels/funnel", params={"from": "soon"})
    assert api.status_code == 400
    assert api.json() == {"error": "from='soon' is neither an ISO-8601 time (e.g. 2025-06-15T12:00:00Z or "
                                   "2025-06-15) nor Unix seconds"}


def test_relative_range_and_refresh_stay_in_every_link(filled: Store) -> None:
    client = TestClient(create_dashboard_app(filled))
    page = client.get("/gaps", params={"range": "1h", "refresh": "30s", "tenant": "t1"}).text
    assert "<meta http-equiv='refresh' content='30'>" in page
    assert "href='/tiers?range=1h&amp;tenant=t1&amp;refresh=30s'" in page
    # the replay is a year old: "last hour" is its last hour, and the page says which clock applied
    assert "ending at the newest stored event" in page
    assert "<option value='1h' selected>" in page and "<option value='30s' selected>" in page
    rows = client.get("/api/panels/headline", params={"range": "1h"}).json()
    assert rows[0]["lookups"] == store_says(filled)["lookups"]  # the whole replay is within its last hour
    assert "http-equiv='refresh'" not in client.get("/gaps").text  # refresh is opt-in


def test_mounted_under_a_prefix_every_link_stays_inside(filled: Store) -> None:
    outer = FastAPI()
    outer.mount("/dashboard", create_dashboard_app(filled))
    client = TestClient(outer)
    for path in PAGES:
        page = client.get(f"/dashboard/{path}", params={"range": "all", "model": "jamba"})
        assert page.status_code == 200, path
        urls = re.findall(r"(?:href|src|action)='([^']*)'", page.text)
        assert urls and all(u.startswith("/dashboard/") for u in urls), (path, urls)
        for url in urls:  # every link, form and script resolves inside the mount
            assert client.get(url.replace("&amp;", "&")).status_code == 200, url
    assert client.get("/dashboard/api/panels/funnel").status_code == 200
    assert "href='/dashboard/'" in client.get("/dashboard/", params={"from": "x"}).text  # the 400's way back


def test_empty_states_name_the_cause_and_the_fix(store: Store) -> None:
    client = TestClient(create_dashboard_app(store))
    nothing = client.get("/").text
    assert "The store holds no events yet" in nothing and "kvtrace ingest" in nothing
    replay(store, verdicts=False)
    unjudged = client.get("/").text  # events, but no lookups judged
    assert "no verdicts" in unjudged and "kvtrace analyze --write-verdicts" in unjudged
    assert "No data" not in unjudged
    assert re.findall(r"<div class='v'>([^<]*)</div>", unjudged) == ["n/a"] * 6
    tiers = client.get("/tiers").text
    assert "None in flight" in tiers  # the simulator's loads all finish before admission


def test_zero_unsafe_reuse_reads_as_good_news(store: Store) -> None:
    replay(store, ENGINES[:1])  # only the correct engine
    client = TestClient(create_dashboard_app(store))
    assert store_says(store)["unsafe_reuses"] == 0
    page = client.get("/unsafe").text
    assert "<div class='tile good' data-stat='unsafe_reuses' data-value='0'><div class='v'>none</div>" in page
    # every lookup judged: the 80 requests' first admissions and 4 re-admissions after a preemption
    assert "<b>None.</b> No request adopted more than was recoverable in this range (84 lookups judged)." in page

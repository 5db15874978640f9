"""Finding one's way in a comparison in Debian's Chromium: next / previous divergence and gap, the
search box, the view kept in the URL (reload, shared link, Back through the propagation trail),
the keyboard path, and screenshots of the comparison view at overview and zoomed in.

On the synthetic scenario pairs of the session (tests/fixtures_runs.py): small, so each test is a
few seconds; the server's search answers the same at a million events (benchmarks/bench_explorer.py)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qs

import httpx
import pytest

import fixtures_runs as runs
from api.conftest import compare as api_compare
from browser.pages import SEL, layer, wait_drawn

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def comparisons(explorer, scenario_dirs, tmp_path_factory) -> dict[str, dict]:
    """The session's probe and gap pairs, and a chain: block 1 diverges at step 1 and feeds block 2, 3..."""
    chain = runs.write_pair(str(tmp_path_factory.mktemp("chain")), "chain",
                            runs.RunSpec(layers=4, steps=3, taints=(runs.Taint(1, "model.layers.1"),)))
    with httpx.Client(base_url=explorer.url, timeout=60) as client:
        out = {name: api_compare(client, scenario_dirs[name]) for name in ("probe", "gap")}
        out["chain"] = api_compare(client, chain)
    return out


def _open(page, explorer, c: dict, rest: str = "") -> None:
    page.goto(f"{explorer.url}/#/c/{c['id']}{rest}")
    wait_drawn(page, c["revision"])


def _selected(page, boundary: str, step_phase: str | None = None) -> None:
    """Until the selected-event panel shows `boundary` (and "step · phase")."""
    page.wait_for_selector(f"{SEL['detailPanel']}[data-boundary='{boundary}'] .digests")
    if step_phase:
        page.wait_for_function("([sel, text]) => document.querySelector(sel).innerText.includes(text)",
                               arg=[SEL["detailPanel"], step_phase], timeout=5_000)


def _hash(page) -> dict:
    h = page.evaluate("location.hash")
    return {k: v if k == "trail" else v[0] for k, v in parse_qs(h.split("?", 1)[1] if "?" in h else "").items()}


def _window(page) -> tuple[float, float]:
    a, b = page.get_attribute(SEL["timeline"], "data-window").split()
    return float(a), float(b)


def _wait_hash(page, key: str, value: str | None = None) -> None:
    test = f"p.get({key!r}) !== null" if value is None else f"p.get({key!r}) === {value!r}"
    page.wait_for_function(f"() => {{ const h = location.hash, i = h.indexOf('?'); if (i < 0) return false;"
                           f" const p = new URLSearchParams(h.slice(i + 1)); return {test}; }}", timeout=5_000)


def test_next_and_previous_divergence_and_gap(page, explorer, comparisons):
    c = comparisons["gap"]  # both ranks skip the probe at step 0; rank 1's block 1 diverges at step 1
    _open(page, explorer, c)
    page.click(SEL["nextGap"])
    _selected(page, "model.probe", "0 · forward")
    assert re.match(r"gap 1 of 1 · step 0", page.inner_text(SEL["navInfo"]))
    page.click(SEL["nextGap"])
    page.wait_for_selector(f"{SEL['navInfo']}.none:has-text('no gap after this one (1 in all)')")
    page.select_option(SEL["rankSelect"], "1")
    page.wait_for_function("(sel) => document.querySelector(sel).dataset.rank === '1'", arg=SEL["timeline"])
    page.click(SEL["nextDivergence"])
    _selected(page, "model.layers.1", "1 · forward")
    first = page.inner_text(SEL["navInfo"])
    assert first.startswith("divergent pair 1 of ") and "model.layers.1" in first, first
    page.click(SEL["nextDivergence"])
    _selected(page, "model.layers.2", "1 · forward")
    page.click(SEL["prevDivergence"])
    _selected(page, "model.layers.1", "1 · forward")
    page.click(SEL["prevDivergence"])
    page.wait_for_selector(f"{SEL['navInfo']}.none:has-text('no divergent pair before this one')")
    page.click(SEL["prevGap"])  # back over the divergences to the skipped probe
    _selected(page, "model.probe", "0 · forward")
    # the timeline shows what was selected: its square is marked
    assert page.evaluate("(sel) => document.querySelector(sel).chart.layers.some((t) => t.name === 'selected')",
                         SEL["timeline"])


def test_search_by_glob_type_phase_and_step_jumps_to_each_match(page, explorer, comparisons):
    c = comparisons["probe"]  # 5 blocks, 3 steps
    _open(page, explorer, c)
    page.fill(SEL["search"], "layers.2 phase:forward")
    page.press(SEL["search"], "Enter")
    _selected(page, "model.layers.2", "0 · forward")
    assert page.inner_text(SEL["searchInfo"]).startswith("1 of 3 · step 0")
    page.press(SEL["search"], "Enter")
    _selected(page, "model.layers.2", "1 · forward")
    page.press(SEL["search"], "Shift+Enter")
    _selected(page, "model.layers.2", "0 · forward")
    # a glob from any dotted part, a module type and a step: the weight gradients of step 2
    page.fill(SEL["search"], "layers.*.weight type:Linear step:2")
    page.click(SEL["searchNext"])
    page.wait_for_function("(sel) => document.querySelector(sel).dataset.total === '5'", arg=SEL["searchInfo"])
    _selected(page, "model.layers.4.weight", "2 · backward")  # the backward runs from the last block
    page.click(SEL["searchPrev"])
    page.wait_for_selector(f"{SEL['searchInfo']}.none:has-text('no match before this one (5 in all)')")
    page.fill(SEL["search"], "step:two")
    page.press(SEL["search"], "Enter")
    page.wait_for_selector(f"{SEL['search']}.bad")
    assert "is not a step" in page.inner_text(SEL["searchInfo"])
    page.fill(SEL["search"], "no.such.module")
    page.press(SEL["search"], "Enter")
    page.wait_for_selector(f"{SEL['searchInfo']}:has-text('no match on rank 0')")


def test_the_view_is_in_the_url_a_reload_restores_it_and_back_walks_the_propagation(page, explorer, comparisons):
    c = comparisons["probe"]
    _open(page, explorer, c)
    page.click(f"{SEL['axisToggle']} button[data-axis=time]")
    page.wait_for_function("(sel) => document.querySelector(sel).dataset.axis === 'time'", arg=SEL["timeline"])
    page.fill(SEL["search"], "layers.3 step:1")
    page.press(SEL["search"], "Enter")
    _selected(page, "model.layers.3", "1 · forward")
    page.click(SEL["zoomIn"])
    _wait_hash(page, "axis", "time")
    page.wait_for_function("(sel) => document.querySelector(sel).dataset.whole === 'false'", arg=SEL["timeline"])
    window = _window(page)
    page.wait_for_timeout(100)
    state = _hash(page)
    assert state["axis"] == "time" and state["sel"].startswith("0.a.") and state["rules"] == "none", state
    # a reload, and the same link in a fresh page: the same axis, window and selected event
    for fresh in (False, True):
        if fresh:
            url = page.url
            page.goto(f"{explorer.url}/#/")
            page.wait_for_selector(f"{SEL['viewHome']}:not(.hidden)")
            page.goto(url)
        else:
            page.reload()
        wait_drawn(page, c["revision"])
        _selected(page, "model.layers.3", "1 · forward")
        assert page.get_attribute(SEL["timeline"], "data-axis") == "time"
        assert _window(page) == pytest.approx(window, rel=1e-6), (_window(page), window)
        assert page.locator(f"{SEL['axisToggle']} button[data-axis=time].on").count() == 1

    # two steps down the propagation trail, each a history entry; Back walks them, a reload keeps them
    _open(page, explorer, comparisons["chain"])
    first = page.locator(f"{SEL['propagation']} .column").nth(1).locator(".node").first
    first.click()
    _wait_hash(page, "trail")
    second = page.locator(f"{SEL['propagation']} .column").nth(2).locator(".node").first
    second.click()
    page.wait_for_function("() => new URLSearchParams(location.hash.split('?')[1]).getAll('trail').length === 2")
    columns = page.locator(f"{SEL['propagation']} .column")
    assert columns.count() == 4
    deep = _hash(page)["trail"]
    page.go_back()
    page.wait_for_function("(sel) => document.querySelectorAll(sel + ' .column').length === 3", arg=SEL["propagation"])
    assert _hash(page)["trail"] == deep[:1]
    page.go_forward()
    page.wait_for_function("(sel) => document.querySelectorAll(sel + ' .column').length === 4", arg=SEL["propagation"])
    page.reload()
    wait_drawn(page, c["revision"])
    page.wait_for_function("(sel) => document.querySelectorAll(sel + ' .column').length === 4", arg=SEL["propagation"])
    assert page.inner_text(SEL["propCrumbs"]).endswith(page.locator(f"{SEL['propagation']} .column").nth(3)
                                                       .locator("h4").get_attribute("title").split(" ", 1)[1])


def test_a_link_made_under_another_rule_set_version_says_so_and_reopens_it(page, explorer, comparisons, scenario_dirs):
    c = comparisons["probe"]
    _open(page, explorer, c, "?rules=rs-gone@3&sel=0.a.1.1")
    page.wait_for_selector(f"{SEL['linkNote']}:not(.hidden)")
    note = page.inner_text(SEL["linkNote"])
    assert "made with another rule set" in note and "now uses no rules" in note, note
    assert page.locator("#link-reopen").count() == 0  # a rule set it does not know: nothing to reopen
    _selected(page, "model.probe", "0 · forward")
    # version 1 ignores the probe (pivot: block 2), version 2 has no rule (pivot: the probe)
    rule = {"id": "probe-debug", "action": "ignore", "match": {"boundary": "model.probe"}}
    with httpx.Client(base_url=explorer.url, timeout=60) as client:
        rs = client.post("/api/rulesets", json={"name": "link versions", "rules": [rule]}).json()
        client.put(f"/api/rulesets/{rs['id']}", json={"rules": []}).raise_for_status()
        c2 = api_compare(client, scenario_dirs["probe"], rule_set_id=rs["id"])
    assert c2["rule_set"]["version"] == 2
    _open(page, explorer, c2, f"?rules={rs['id']}@1")
    # (only the hash changes: the page is not reloaded, and the note of the link before stays up until this one's
    # comparison is drawn; its revision may equal the one before, so wait for the note to change)
    page.wait_for_function("([sel, text]) => !document.querySelector(sel).innerText.includes(text)",
                           arg=[SEL["linkNote"], "now uses no rules"], timeout=15_000)
    page.wait_for_selector(f"{SEL['linkNote']}:not(.hidden)")
    note = page.inner_text(SEL["linkNote"])
    assert "with version 1 of rule set link versions" in note and "now uses version 2" in note, note
    assert page.inner_text("#pivot-boundary") == "model.probe"
    page.click("#link-reopen")
    wait_drawn(page, c2["revision"] + 1)
    page.wait_for_selector(SEL["linkNote"], state="hidden")
    assert page.inner_text("#pivot-boundary") == "model.layers.2"
    _wait_hash(page, "rules", f"{rs['id']}@1")


def test_the_keyboard_path(page, explorer, comparisons, artifacts):
    c = comparisons["chain"]  # block 1 diverges at step 1, and all after it
    _open(page, explorer, c)
    page.screenshot(path=str(artifacts / "comparison-view-zoomed-in.png"), full_page=True)
    page.keyboard.press("?")
    page.wait_for_selector(f"{SEL['keysOverlay']}:not(.hidden) table.keys")
    listed = page.inner_text(f"{SEL['keysOverlay']} table.keys")
    assert "next divergent pair" in listed and "zoom in" in listed and "search" in listed
    page.keyboard.press("Escape")
    page.wait_for_selector(SEL["keysOverlay"], state="hidden")
    # the pivot, then the next divergent pair and the event after it
    page.keyboard.press("p")
    _selected(page, "model.layers.1", "1 · forward")
    page.keyboard.press("n")
    _selected(page, "model.layers.2", "1 · forward")
    page.keyboard.press("ArrowRight")
    _selected(page, "model.layers.3", "1 · forward")
    page.keyboard.press("k")
    _selected(page, "model.layers.2", "1 · forward")
    # zoom out to the whole rank and in again
    page.keyboard.press("0")
    page.wait_for_function("(sel) => document.querySelector(sel).dataset.whole === 'true'", arg=SEL["timeline"])
    page.screenshot(path=str(artifacts / "comparison-view-overview.png"), full_page=True)
    whole = _window(page)
    page.keyboard.press("+")
    page.wait_for_function(f"(sel) => {{ const [s, e] = document.querySelector(sel).dataset.window.split(' ').map(Number);"
                           f" return e - s < {(whole[1] - whole[0]) * 0.6}; }}", arg=SEL["timeline"])
    page.keyboard.press("-")
    page.wait_for_function("(sel) => document.querySelector(sel).dataset.whole === 'true'", arg=SEL["timeline"])
    # "/" focuses the search; Enter finds; Escape gives the keys back to the page
    page.keyboard.press("/")
    assert page.evaluate("document.activeElement.id") == SEL["search"].lstrip("#")
    page.keyboard.type("layers.3 step:2")
    page.keyboard.press("Enter")
    _selected(page, "model.layers.3", "2 · forward")
    page.keyboard.press("Escape")
    page.keyboard.press("t")
    page.wait_for_function("(sel) => document.querySelector(sel).dataset.axis === 'time'", arg=SEL["timeline"])
    # the propagation nodes are reached by Tab and opened with Enter: the pivot, then what it fed
    page.focus(f"{SEL['propagation']} .column .node.pivot")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.dataset.boundary") == "model.layers.2"
    page.keyboard.press("Enter")
    page.wait_for_function("(sel) => document.querySelectorAll(sel + ' .column').length === 3", arg=SEL["propagation"])
    _selected(page, "model.layers.2", "1 · forward")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.dataset.boundary") == "model.layers.3"


def test_every_shortcut_is_in_the_readme():
    table = (ROOT / "frontend" / "js" / "keys.js").read_text().split("export const SHORTCUTS = [", 1)[1].split("];", 1)[0]
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Keyboard", 1)[1].split("\n#", 1)[0]
    for keys, what in re.findall(r'^\s*\[\[(.*?)\], "([^"]+)"', table, re.M):
        assert what in section, f"README's Keyboard section does not say what {keys} does ({what})"
        for k in re.findall(r'"([^"]+)"', keys):
            assert f"`{k}`" in section, f"README's Keyboard section does not show the key {k}"


def test_slices_nested_by_depth_and_the_merged_view(page, explorer, comparisons, artifacts):
    c = comparisons["chain"]  # forward: blocks 0..3 (depth 1) then the root module Net (depth 0)
    _open(page, explorer, c, "?w=0,16")  # step 0 and a little of step 1: each event drawn
    page.click(f"{SEL['drawToggle']} button[data-draw=slices]")
    page.wait_for_function("(sel) => document.querySelector(sel).dataset.draw === 'slices'", arg=SEL["timeline"])
    bars = page.evaluate(r"""(sel) => { const t = document.querySelector(sel).chart.layers.find((t) => t.name === "slices");
        return t.custom.map((c, i) => ({side: c[0], pos: c[2], base: t.x0[i], width: t.x1[i] - t.x0[i], y: t.y[i],
                                        text: t.hover[i][1].match(/^\S+ (.+) \(/)[1]})); }""",
                         SEL["timeline"])
    net = next(b for b in bars if b["side"] == "a" and b["text"] == "Net")
    blocks = [b for b in bars if b["side"] == "a" and "layers." in b["text"] and b["pos"] < net["pos"]]
    assert len(blocks) == 4 and all(b["width"] == 1 for b in blocks), blocks
    # the root spans its children, one row above them in the lane
    assert net["base"] == min(b["pos"] for b in blocks) and net["base"] + net["width"] == net["pos"] + 1, net
    assert all(net["y"] < b["y"] for b in blocks)
    names = layer(page, "slice names")["text"]
    assert "Net" in names and "probe" in names, names  # named where they fit, by the last parts that fit
    page.screenshot(path=str(artifacts / "comparison-slices.png"), full_page=True)
    # a click on a slice selects its event
    box = page.evaluate("""([sel, pos]) => { const c = document.querySelector(sel).chart, b = c.canvas.getBoundingClientRect();
        return {x: b.left + c.size.l + c.x2p(pos + 0.5), y: b.top + c.size.t + c.y2p(%s)}; }""" % net["y"],
                        [SEL["timeline"], net["pos"] - 1])
    page.mouse.move(box["x"], box["y"])
    page.wait_for_timeout(150)
    page.mouse.click(box["x"], box["y"])
    _selected(page, "Net", "0 · forward")

    # merged: one lane per phase; what agrees drawn once and faint, the divergences stand out
    page.keyboard.press("d")
    page.wait_for_function("(sel) => document.querySelector(sel).dataset.draw === 'merged'", arg=SEL["timeline"])
    _wait_hash(page, "draw", "merged")
    drawn = page.evaluate("""(sel) => { const c = document.querySelector(sel).chart;
        const n = (name) => c.layers.find((t) => t.name === name).x.length;
        return {same: n("A = B"), differs: n("A ≠ B"), ticks: c.ticks.y.map((t) => t.text)}; }""", SEL["timeline"])
    with httpx.Client(base_url=explorer.url, timeout=30) as client:
        truth = client.get(f"/api/comparisons/{c['id']}/timeline", params={"rank": 0, "start": 0, "end": 16}).json()
    statuses = [e["status"] for e in truth["events"]]
    assert drawn["differs"] == statuses.count("diverged") > 0 and drawn["same"] == statuses.count("identical"), drawn
    assert all(t.startswith("A·B · ") for t in drawn["ticks"]) and len(drawn["ticks"]) == len(truth["lanes"]) // 2
    page.screenshot(path=str(artifacts / "comparison-merged.png"), full_page=True)

"""Strings from an uploaded run are drawn as text: a boundary and a module type holding HTML create
no link and no styled element in the timelines (canvas, with DOM text and a tooltip made with
textContent; the loss curve and the drill's figures are plotly's, which renders a subset of HTML in
ticks and hover text), in the pivot panel or in the selected-event panel. (A phase is one of four
words: a run with any other is refused at upload, tested below.)"""

from __future__ import annotations

import shutil

import duckdb
import httpx
import pytest

from api.conftest import compare as api_compare
from browser.pages import SEL, mark_xy, wait_drawn

pytestmark = pytest.mark.browser

HOSTILE = "<a href=x>y</a><b style=color:red>z</b>"
BOUNDARY = f"model.probe{HOSTILE}"
MODULE_TYPE = f"Probe{HOSTILE}"
PHASE = f"probe{HOSTILE}"

# links, and elements made of the <b style=...>z</b> part, that plotly (or anyone) made inside the roots
MADE = """(roots) => {
  const out = {links: 0, styled: 0};
  for (const sel of roots) {
    for (const root of document.querySelectorAll(sel)) {
      out.links += root.querySelectorAll("svg a, a[href='x']").length;
      out.styled += Array.from(root.querySelectorAll("tspan, b, span, [style]")).filter((n) =>
        n.textContent === "z" || /(fill|color):\\s*red/.test(n.getAttribute("style") || "")).length;
    }
  }
  return out;
}"""


@pytest.fixture(scope="module")
def hostile_pair(scenario_dirs, tmp_path_factory):
    """The probe pair with the probe's boundary and module type replaced by HTML, on both sides."""
    root = tmp_path_factory.mktemp("hostile")
    out = []
    for side, source in zip(("reference", "suspect"), scenario_dirs["probe"]):
        folder = root / side
        shutil.copytree(source, folder)
        con = duckdb.connect(str(folder / "rank-0.duckdb"))
        try:
            con.execute("UPDATE events SET boundary = ?, module_type = ? WHERE boundary = 'model.probe'",
                        [BOUNDARY, MODULE_TYPE])
            con.execute("CHECKPOINT")
        finally:
            con.close()
        out.append(str(folder))
    return tuple(out)


def test_a_plotly_label_with_html_would_make_a_link(page, explorer):
    """The check below can fail: the same string, unescaped, does become a link in plotly."""
    page.goto(explorer.url + "/")
    page.evaluate("async () => (await import('/static/js/dom.js')).plotly()")  # loaded on demand
    page.evaluate("""(text) => {
      const div = document.createElement("div");
      div.id = "scratch";
      document.body.append(div);
      return window.Plotly.newPlot(div, [{x: [0], y: [0]}], {yaxis: {tickvals: [0], ticktext: [text]}});
    }""", HOSTILE)
    made = page.evaluate(MADE, ["#scratch"])
    assert made["links"] >= 1 and made["styled"] >= 1, made


def test_a_run_whose_phase_is_not_a_phase_is_refused_at_upload(explorer, scenario_dirs, tmp_path):
    from api.conftest import run_files

    folder = tmp_path / "reference"
    shutil.copytree(scenario_dirs["probe"][0], folder)
    con = duckdb.connect(str(folder / "rank-0.duckdb"))
    try:
        con.execute("UPDATE events SET phase = ? WHERE boundary = 'model.probe'", [PHASE])
        con.execute("CHECKPOINT")
    finally:
        con.close()
    with httpx.Client(base_url=explorer.url, timeout=60) as client:
        r = client.post("/api/runs", files=run_files(str(folder)))
    assert r.status_code == 400 and "events.phase" in r.json()["error"]["message"], r.text


def test_boundary_and_module_type_with_html_are_drawn_as_text(page, explorer, hostile_pair, artifacts):
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    with httpx.Client(base_url=explorer.url, timeout=60) as client:
        c = api_compare(client, hostile_pair)
    assert c["summary"]["first_divergence"]["boundary"] == BOUNDARY
    page.goto(f"{explorer.url}/#/c/{c['id']}")
    wait_drawn(page, 1)
    roots = [SEL["timeline"], SEL["overview"], SEL["pivotPanel"], SEL["detailPanel"], SEL["propagation"]]

    # the propagation view starts at the pivot, named as it is (its node id holds the boundary's "/")
    page.wait_for_selector(f"{SEL['propagation']} .node.pivot")
    assert page.get_attribute(f"{SEL['propagation']} .node.pivot", "data-boundary") == BOUNDARY
    assert page.inner_text(f"{SEL['propagation']} .node.pivot .b") == BOUNDARY
    # the pivot panel names the boundary as it is, as text
    assert page.inner_text("#pivot-boundary") == BOUNDARY
    assert page.evaluate(MADE, roots) == {"links": 0, "styled": 0}

    # hover the pivot: its label holds the boundary as text
    pos = c["pivot_position"]["pos"]
    index = page.evaluate("""([sel, pos]) => document.querySelector(sel).chart.layers.find((t) => t.name === "run A")
      .custom.findIndex((d) => d[2] === pos)""", [SEL["timeline"], pos])
    point = mark_xy(page, "run A", index)
    page.mouse.move(point["x"], point["y"])
    page.wait_for_selector(f"{SEL['timeline']} .chart-tip:not(.hidden)")
    hover = page.eval_on_selector(f"{SEL['timeline']} .chart-tip", "n => n.textContent")
    assert BOUNDARY in hover, hover
    page.screenshot(path=str(artifacts / "comparison-html-in-run-strings.png"), full_page=True)
    assert page.evaluate(MADE, roots) == {"links": 0, "styled": 0}

    # select it: the selected-event panel shows the same text, no markup
    page.mouse.click(point["x"], point["y"])
    page.wait_for_selector(f"{SEL['detailPanel']} .digests")
    assert page.get_attribute(SEL["detailPanel"], "data-boundary") == BOUNDARY
    assert BOUNDARY in page.inner_text(SEL["detailPanel"])
    assert page.evaluate(MADE, roots) == {"links": 0, "styled": 0}
    assert errors == []
    assert "error" not in (page.get_attribute(SEL["toast"], "class") or ""), page.inner_text(SEL["toast"])

"""The violations view of a run: reached from the runs table's Invariants button, the violations it
recorded with --check (a filter by invariant, a row's evidence), then the run checked against an
invariants file picked in the page (the violations found, the skipped invariants and why); HTML in
a message is drawn as text."""

from __future__ import annotations

import json

import httpx
import pytest

from api.conftest import upload
from bitguard.backend.invariants.infer import infer
from invariant_loops import Loop, write_run

pytestmark = pytest.mark.browser

HOSTILE = "zero_grad <b id=made>x</b> before backward"


def row(step, iid, rank=0):
    return {"step": step, "rank": rank, "invariant_id": iid, "template": iid.split("/")[0], "message": HOSTILE,
            "t_ns": step, "evidence": json.dumps({"zero_grad_ords": [], "step": step})}


@pytest.fixture(scope="module")
def checked(explorer, tmp_path_factory):
    root = tmp_path_factory.mktemp("violations-view")
    run = write_run(root, Loop(seed="v", bugs={"dropout_eval"}, params=("enc.weight", "h.0.weight")),
                    name="violations-view-run", meta={"check": {"invariants": 3}},
                    violations=[row(1, "EventContain/zero_grad_before_backward"), row(2, "Mode/all_training"),
                                row(3, "Mode/all_training")])
    inv = root / "inv.json"
    inv.write_text(json.dumps(infer({"a": Loop(seed="a").run(), "b": Loop(seed="b").run()})))
    with httpx.Client(base_url=explorer.url, timeout=30) as client:
        return upload(client, str(run)), inv


def test_recorded_violations_then_an_offline_check(page, explorer, checked):
    run, inv = checked
    page.goto(explorer.url + "/#/")
    page.locator(f"tr[data-run-id='{run['id']}'] a", has_text="Invariants").click()
    page.wait_for_selector("#violations-table")
    assert page.locator("#violations-verdict").inner_text() == "violated"
    rows = page.locator("#violations-table tr[data-invariant]")
    assert [rows.nth(i).get_attribute("data-step") for i in range(rows.count())] == ["1", "2", "3"]
    assert page.locator("#made").count() == 0, "a message's HTML was drawn as text"
    assert HOSTILE in rows.nth(0).inner_text()
    page.select_option("#violations-filter", "Mode/all_training")
    assert page.locator("#violations-table tr[data-invariant]").count() == 2
    page.locator("#violations-table tr[data-invariant]").nth(0).click()
    assert '"step": 2' in page.locator("#violation-evidence").inner_text()

    page.set_input_files("#violations-file", str(inv))
    page.wait_for_selector("#violations-source:has-text('Checked offline against inv.json')")
    page.wait_for_selector("#violations-skipped", state="attached")
    ids = {page.locator("#violations-table tr[data-invariant]").nth(i).get_attribute("data-invariant")
           for i in range(page.locator("#violations-table tr[data-invariant]").count())}
    assert "Mode/all_training" in ids
    assert "names absent" in page.locator("#violations-skipped").text_content()
    page.click("#violations-recorded")
    assert page.locator("#violations-table tr[data-invariant]").count() == 3

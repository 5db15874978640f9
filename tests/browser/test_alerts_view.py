"""The alerts view of an online-mode run: reached from the runs table's Alerts button, the alerts in
their latest state, a filter by state, a confirmed alert's replay advice, the coverage table; a run
of another mode is the server's refusal; HTML in a boundary is drawn as text."""

from __future__ import annotations

import httpx
import pytest

import fixtures_runs as runs
from api.conftest import upload
from online_runs import alert, online_run, stats

pytestmark = pytest.mark.browser

HOSTILE = "blocks.0<b id=made>x</b>"


@pytest.fixture(scope="module")
def online(explorer, tmp_path_factory):
    root = tmp_path_factory.mktemp("online-view")
    run = online_run(root, [alert(0, "pending", step=9, boundary=HOSTILE),
                            alert(0, "confirmed", step=9, t=1, latency_steps=2, boundary=HOSTILE,
                                  evidence='{"summary": "the re-runs reproduce the forward"}'),
                            alert(1, "pending", step=12), alert(1, "cleared", step=12, t=1, latency_steps=0),
                            alert(2, "warning", step=14, sensor="guard", severity="warning", boundary="loss", op="loss",
                                  evidence='{"summary": "loss 9.1 > 3.2"}')],
                     [stats(s) for s in range(20)], name="online-view-run")
    full = runs.write_run(str(root / "full-view-run"), runs.RunSpec(layers=2, steps=1))
    with httpx.Client(base_url=explorer.url, timeout=30) as client:
        return upload(client, str(run)), upload(client, full)


def test_the_alerts_of_an_online_run(page, explorer, online):
    run, _ = online
    page.goto(explorer.url + "/#/")
    page.locator(f"tr[data-run-id='{run['id']}'] a", has_text="Alerts").click()
    page.wait_for_selector("#alerts-table")
    assert page.locator("#alerts-verdict").inner_text() == "1 confirmed"
    rows = page.locator("#alerts-table tr[data-alert]")
    assert rows.count() == 3
    assert [rows.nth(i).get_attribute("data-state") for i in range(3)] == ["confirmed", "cleared", "warning"]
    assert page.locator("#made").count() == 0, "a boundary's HTML was drawn as text"
    assert HOSTILE in rows.nth(0).inner_text()
    rows.nth(0).click()
    advice = page.locator("#alert-afterwards").inner_text()
    assert "--steps 9:10" in advice and "bitguard compare runs/step-9-healthy runs/step-9-suspect" in advice
    page.select_option("#alerts-filter", "warning")
    assert page.locator("#alerts-table tr[data-alert]").count() == 1
    assert page.locator("#alerts-coverage tr[data-sensor='checksum']").count() == 1
    assert "2 median" in page.locator("#alerts-verifier").inner_text()


def test_a_run_of_another_mode_says_why(page, explorer, online):
    _, full = online
    page.goto(explorer.url + f"/#/r/{full['id']}/alerts")
    error = page.wait_for_selector("#alerts-error")
    assert "--mode online" in error.inner_text() and "full mode" in error.inner_text()

"""The SDC simulator: off unless BITGUARD_SDC_SIMULATE asks, recorded in the manifest when on; it
corrupts only the chosen Linear, only rows whose input hash is in range, from the chosen step, at
the chosen bit or by r × the operator's median checksum gap; a bad spec is one clear message."""

import json

import pytest
import torch

import bitguard
from bitguard.collectors.online.checksum import column_gaps
from bitguard.collectors.online.simulator import ENV, Simulator, Spec, parse, row_hashes
from bitguard.errors import BadInput
from online_tiny import build, train


class _Monitor:
    enabled = True
    step = 0

    def module_name(self, module):
        return "m"

    def guard(self, fn):
        return fn


def _call(sim, x, monitor):
    lin = torch.nn.Linear(x.shape[1], 6)
    with torch.no_grad():
        clean = torch.nn.functional.linear(x, lin.weight, lin.bias)
    y = clean.clone()
    sim.monitor = monitor
    sim.corrupt(lin, x, y)
    return clean, y


@pytest.mark.parametrize("bit", [31, 27, 3])
def test_a_bit_flip_hits_only_rows_whose_hash_is_in_range(bit):
    torch.manual_seed(0)
    x = torch.randn(40, 8)
    h = row_hashes(x)
    sim = Simulator(Spec(module="m", bit=bit, hash_range=(0.25, 0.5), rows=40), None)
    clean, y = _call(sim, x, _Monitor())
    hit = [i for i in range(40) if 0.25 <= h[i] < 0.5]
    assert hit and len(hit) < 40
    assert [r["row"] for r in sim.injected] == hit
    diff = (clean.view(torch.int32) ^ y.view(torch.int32)).nonzero().tolist()
    assert [[r["row"], r["col"]] for r in sim.injected] == diff
    for r in sim.injected:
        assert (clean.view(torch.int32)[r["row"], r["col"]] ^ y.view(torch.int32)[r["row"], r["col"]]).item() \
            & 0xFFFFFFFF == 1 << bit


def _largest_gap(lin, x, y):
    _, raw, _ = column_gaps(y, x, lin.weight.detach().T, lin.bias.detach())
    return float(raw.max())


def test_rate_steps_and_scale():
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    sim = Simulator(Spec(module="m", scale=100.0, from_step=2, to_step=3), None)
    m = _Monitor()
    clean, y = _call(sim, x, m)
    assert torch.equal(clean, y), "before from_step nothing changes"
    m.step = 2
    lin = torch.nn.Linear(8, 6)
    with torch.no_grad():
        clean = torch.nn.functional.linear(x, lin.weight, lin.bias)
    y = clean.clone()
    sim.corrupt(lin, x, y)
    gap = _largest_gap(lin, x, clean)
    assert gap > 0 and sim.injected[0]["delta"] == pytest.approx(100 * gap), \
        "r x the median of the clean calls' largest column-sum gaps, this call's included"
    assert (y - clean).abs().max().item() == pytest.approx(100 * gap, rel=1e-2)
    m.step = 3
    clean, y = _call(sim, x, m)
    assert torch.equal(clean, y), "to_step is exclusive"
    sim = Simulator(Spec(module="m", scale=10.0), None)
    exact = torch.nn.Linear(8, 6)
    with torch.no_grad():
        exact.weight.copy_(torch.randint(-3, 4, (6, 8)).float())
        exact.bias.zero_()
        xi = torch.randint(-3, 4, (4, 8)).float()
        y = torch.nn.functional.linear(xi, exact.weight, exact.bias)
    sim.monitor = _Monitor()
    sim.corrupt(exact, xi, y)
    assert not sim.injected and sim.skipped == 1, "an exact product has no clean gap to scale by"
    sim = Simulator(Spec(module="m", bit=30, rate=0.0), None)
    clean, y = _call(sim, x, _Monitor())
    assert torch.equal(clean, y)


@pytest.mark.parametrize("text,words", [
    ("{", "not JSON"), ("[1]", "JSON object"), ('{"module": "m"}', "exactly one of"),
    ('{"module": "m", "bit": 3, "scale": 1}', "exactly one of"), ('{"bit": 3}', "'module'"),
    ('{"module": "m", "bit": 99}', "'bit'"), ('{"module": "m", "bit": 1, "rate": 2}', "'rate'"),
    ('{"module": "m", "bit": 1, "hash_range": [0.5, 0.2]}', "'hash_range'"),
    ('{"module": "m", "bit": 1, "typo": 1}', "unknown field"),
])
def test_a_bad_spec_is_one_clear_message(text, words):
    with pytest.raises(BadInput, match=words):
        parse(text)


def test_off_unless_asked_and_recorded_in_the_manifest_when_on(tmp_path, monkeypatch):
    model, opt, data = build()
    with bitguard.record(tmp_path / "plain", mode="online"):
        train(model, opt, data, 1)
    assert json.loads((tmp_path / "plain" / "manifest.json").read_text())["online"]["sdc_simulate"] is None
    assert not (tmp_path / "plain" / "sdc-injections-rank-0.jsonl").exists()
    spec = {"module": "blocks.0.attn.proj", "bit": 30, "from_step": 1}
    monkeypatch.setenv(ENV, json.dumps(spec))
    model, opt, data = build()
    with bitguard.record(tmp_path / "sim", mode="online"):
        train(model, opt, data, 2)
    recorded = json.loads((tmp_path / "sim" / "manifest.json").read_text())["online"]["sdc_simulate"]
    assert {k: recorded[k] for k in spec} == spec
    lines = (tmp_path / "sim" / "sdc-injections-rank-0.jsonl").read_text().splitlines()
    assert lines and all(json.loads(line)["step"] == 1 for line in lines)

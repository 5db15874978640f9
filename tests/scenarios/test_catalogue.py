"""The scenario catalogue, the scoring of a verdict, the committed demo pair and `bitguard eval`'s
command line: everything about the evaluation that needs no new recording."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bitguard
from bitguard.backend.compare import compare
from bitguard.backend.rules import RuleSet
from bitguard.cli import main as cli
from bitguard.errors import BadInput
from bitguard.sample_traces import evaluation, hf_train, tinygpt
from bitguard.sample_traces.scenarios import DEMO, SCENARIOS, Expected, Site
from bitguard.schema import PHASES

ROOT = Path(__file__).resolve().parents[2]
DEMO_DIR = ROOT / "sample_traces" / "demo"
KINDS = {"forward": "module", "backward": ("module", "grad"), "optimizer": "step", "data": "batch"}


def test_the_catalogue_covers_every_fault_family():
    # the families the published evaluation names, one scenario at least for each
    required = {"forward-bitflip", "functional", "backward", "embedding-race", "grad-accum", "optimizer",
                "data-order", "rng-shift", "bf16-variance", "nondeterministic", "swap", "double-flip"}
    assert required <= set(SCENARIOS)
    assert len(SCENARIOS) >= 12
    assert any(s.expected is None and s.rules for s in SCENARIOS.values()), "a benign pair with its rules"
    assert any(s.script == "hf_train.py" for s in SCENARIOS.values()), "a model nobody here wrote"
    assert [n for n, s in SCENARIOS.items() if s.reruns_differ] == ["nondeterministic"]


@pytest.mark.parametrize("scenario", [*SCENARIOS.values(), DEMO], ids=lambda s: s.name)
def test_each_scenario_is_well_formed(scenario):
    parse = {"tinygpt.py": tinygpt.parse_args, "hf_train.py": hf_train.parse_args}[scenario.script]
    ref, sus = parse(list(scenario.reference)), parse(list(scenario.suspect))
    assert ref.fault is None and (sus.fault is not None), "the suspect, and only it, carries the fault"
    assert scenario.located in ("exact", "first-consumer")
    if scenario.rules:
        assert RuleSet.load(scenario.rules_path).rules, f"{scenario.rules} holds no rule"
    e = scenario.expected
    if e is None:
        return
    assert e.phase in PHASES and e.kind in KINDS[e.phase], e
    assert e.blame in ("source", "consumer", "data") and e.fault_class in (
        "forward", "backward", "accumulation", "optimizer", "data", "rng")
    assert (e.blame == "consumer") == (e.window is not None and e.kind == "module"), \
        "a consumer blame names its window, a source blame of a module does not"
    assert e.site not in scenario.consumers and all(c.step >= e.step for c in scenario.consumers)


def _summary(pivot: dict | None, gaps: int = 0) -> dict:
    return {"verdict": "identical" if pivot is None else "diverged", "pivot": pivot, "unallowed_gaps": gaps}


def _pivot(e: Expected | Site, blame: str = "source", kind: str = "module") -> dict:
    return {"step": e.step, "phase": e.phase, "kind": getattr(e, "kind", kind), "boundary": e.boundary,
            "blame": getattr(e, "blame", blame), "fault_class": getattr(e, "fault_class", e.phase),
            "window": getattr(e, "window", None)}


def test_scoring_of_a_fault():
    s = SCENARIOS["swap"]
    assert evaluation.score(s, _summary(_pivot(s.expected))) == "exact"
    assert evaluation.score(s, _summary(_pivot(s.consumers[0], "consumer"))) == "first-consumer"
    assert evaluation.score(s, _summary(_pivot(Site(2, "forward", "blocks.0.attn.qkv")))) == "wrong"
    wrong_blame = dict(_pivot(s.expected), blame="consumer")
    assert evaluation.score(s, _summary(wrong_blame)) == "wrong"
    assert evaluation.score(s, _summary(None)) == "missed"
    f = SCENARIOS["functional"]
    assert evaluation.score(f, _summary(_pivot(f.expected))) == "first-consumer"


def test_scoring_of_a_benign_pair():
    s = SCENARIOS["benign-dropout"]
    assert evaluation.score(s, _summary(None)) == "accepted"
    assert evaluation.score(s, _summary(None, gaps=6)) == "false alarm"
    assert evaluation.score(s, _summary(_pivot(Site(1, "forward", "stats")))) == "false alarm"


def test_loss_watcher():
    ref = [4.0, 3.9, 3.8, 3.7]
    assert evaluation.loss_noticed(ref, [4.0, 3.9, 3.8, 3.7]) is None
    assert evaluation.loss_noticed(ref, [4.0, 3.9 * (1 + 5e-4), 3.8 * (1 + 2e-3), 3.7]) == 2
    assert evaluation.loss_gap(ref, [4.0, 3.9, 3.8 * (1 + 2e-3), 3.7]) == pytest.approx(2e-3)


def test_demo_pair_is_small_and_shows_its_fault():
    files = [p for p in DEMO_DIR.rglob("*") if p.is_file()]
    assert {p.relative_to(DEMO_DIR).as_posix() for p in files} == {
        "reference/manifest.json", "reference/rank-0.duckdb", "suspect/manifest.json", "suspect/rank-0.duckdb"}
    assert sum(p.stat().st_size for p in files) < 2_000_000
    for side, args in (("reference", DEMO.reference), ("suspect", DEMO.suspect)):
        manifest = json.loads((DEMO_DIR / side / "manifest.json").read_text())
        assert manifest["command"] == [f"sample_traces/{DEMO.script}", *args] and manifest["status"] == "complete"
    got = evaluation.pivot_summary(bitguard.compare(DEMO_DIR / "reference", DEMO_DIR / "suspect").first_divergence)
    assert evaluation.score(DEMO, _summary(got)) == "exact", got


def test_compare_options_on_the_demo_pair():
    a, b = DEMO_DIR / "reference", DEMO_DIR / "suspect"
    full = compare(a, b)
    xor = compare(a, b, fingerprint="xor")
    assert xor.first_divergence["a_seq"] == full.first_divergence["a_seq"]
    assert xor.to_dict()["analysis"] == {"fingerprint": "xor", "probes": None, "resumed_at": 0}
    few = compare(a, b, probes=["GPT", "lm_head.weight"])
    assert set(few.events()["boundary"].unique()) == {"GPT", "lm_head.weight"}
    p = few.first_divergence
    assert (p["step"], p["phase"], p["boundary"], p["blame"]) == (2, "forward", "GPT", "source")
    with pytest.raises(BadInput, match="--dump"):
        compare(a, b, fingerprint="sum")


def test_eval_refuses_an_unknown_scenario(tmp_path, capsys):
    assert cli(["eval", "no-such-scenario", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown scenario(s) no-such-scenario; known: forward-bitflip" in err
    assert not any(tmp_path.iterdir()), "nothing is recorded for a bad request"


def test_scenarios_list_prints_the_manifest(capsys):
    from bitguard.sample_traces.scenarios import main

    assert main(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in listed] == list(SCENARIOS)
    assert listed[0]["expected"]["boundary"] == "blocks.1.mlp.fc"


def test_evaluation_doc_names_every_scenario_and_its_commands():
    doc = (ROOT / "docs" / "EVALUATION.md").read_text()
    for name in SCENARIOS:
        assert f"| {name} " in doc, f"docs/EVALUATION.md has no row for scenario {name}"
    for command in ("bitguard eval --ablations --fresh --out runs/eval", "pytest -m slow tests/scenarios",
                    "python -m bitguard.sample_traces.scenarios demo"):
        assert command in doc, command
    for method in evaluation.METHODS:
        assert f"`{method.name}`" in doc, f"docs/EVALUATION.md does not explain ablation {method.name}"

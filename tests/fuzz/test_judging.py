"""The fuzz harness's judges on answers made up for the purpose (fast tier: no bitguard run).

A judge that called a false "identical" ok, or a clean refusal a traceback, would make the fuzz
tier and docs/RELIABILITY.md's table lie; these pin each outcome rule of harness.py's docstring.
"""

from __future__ import annotations

from pathlib import Path

from .families import judge_damage
from .harness import Result, crashed, grouped, judge_cli, said_damaged

ROOT = Path("/tmp/bitguard-fuzz-test")
ORIG = {"ok": True, "events": ["0:a", "0:b", "0:c"], "steps": [0, 0, 1], "tensors": ["0:t"],
        "facts": {"status": "complete"}, "ranks": [0]}


def answer(rc, stdout="", stderr=""):
    return {"rc": rc, "stdout": stdout, "stderr": stderr}


def test_hangs_crashes_and_internal_errors_are_told_apart_from_answers():
    assert crashed("hang").outcome == "hang"
    assert crashed("died: exit status -11 (SIGSEGV)").outcome == "traceback"
    assert crashed(answer(70, stderr="bitguard compare: internal error (X)")).outcome == "traceback"
    assert crashed(answer(1, stderr="Traceback (most recent call last):\n  ...\nKeyError: 'x'")).outcome == "traceback"
    assert crashed(answer("exception", stderr="boom")).outcome == "traceback"
    assert crashed(answer(2, stderr="bitguard compare: error: no manifest.json")) is None
    assert crashed(answer(3, stdout="VERDICT: inconclusive")) is None


def test_identical_for_a_damaged_side_is_a_false_verdict_and_for_an_intact_one_ok():
    damaged = {**ORIG, "events": ["0:a", "0:x", "0:c"]}
    assert judge_damage(answer(0, "VERDICT: identical"), damaged, ORIG, False, ROOT).outcome == "false_verdict"
    assert judge_damage(answer(0, "VERDICT: identical"), "hang", ORIG, False, ROOT).outcome == "false_verdict"
    assert judge_damage(answer(0, "VERDICT: identical"), dict(ORIG), ORIG, False, ROOT).outcome == "ok"
    manifest_says_failed = {**ORIG, "facts": {"status": "failed"}}
    assert judge_damage(answer(0), manifest_says_failed, ORIG, False, ROOT).outcome == "false_verdict"


def test_events_lost_without_a_word_of_damage_are_data_lost():
    fewer = {**ORIG, "events": ["0:a", "0:c"]}
    quiet = answer(1, "VERDICT: diverged — run B lacks the forward of x")
    assert judge_damage(quiet, fewer, ORIG, False, ROOT).outcome == "data_lost"
    told = answer(3, "VERDICT: inconclusive\n  • run B rank 0 is damaged from step 1 on")
    assert judge_damage(told, fewer, ORIG, False, ROOT).outcome == "ok"
    assert judge_damage(answer(2, stderr="error: corrupt"), fewer, ORIG, False, ROOT).outcome == "clean_error"
    assert judge_damage(quiet, fewer, ORIG, False, ROOT, count_lost=False).outcome == "ok"


def test_a_journal_cut_short_to_a_prefix_is_what_a_kill_leaves_not_data_lost():
    prefix = {**ORIG, "events": ["0:a", "0:b"]}
    assert judge_damage(answer(3, "VERDICT: inconclusive"), prefix, ORIG, True, ROOT).outcome == "ok"
    assert judge_damage(answer(3, "VERDICT: inconclusive"), prefix, ORIG, False, ROOT).outcome == "data_lost"


def test_damage_words_in_the_run_paths_do_not_count_as_the_tool_saying_so():
    text = f"bitguard compare  A={ROOT}/cases/1/damaged  B={ROOT}/cases/1/corrupt-copy\nVERDICT: diverged"
    assert not said_damaged(answer(1, text), ROOT)
    assert said_damaged(answer(3, text + "\n  • run B is damaged from step 2 on"), ROOT)


def test_diverged_for_unchanged_content_is_a_wrong_answer():
    assert judge_damage(answer(1, "VERDICT: diverged"), dict(ORIG), ORIG, False, ROOT).outcome == "wrong_answer"


def test_an_answer_is_judged_against_what_the_input_calls_for():
    assert judge_cli(answer(2, stderr="bitguard compare: error: x"), "error").outcome == "clean_error"
    assert judge_cli(answer(0, "VERDICT: identical"), "error").outcome == "wrong_answer"
    assert judge_cli(answer(2, stderr="error: x"), "identical").outcome == "wrong_answer"
    assert judge_cli(answer(2, stderr="error: root:x:0:0:root:/root:/bin/bash"), "error").outcome == "unsafe"


def test_failures_are_grouped_by_what_happened_not_by_their_numbers():
    rs = [Result("mutated", f"c{i}", "traceback", f"truncate size={i} at byte {i * 7}: exit 70: OSError at {i}")
          for i in range(5)] + [Result("api", "x", "http_500", "HTTP 500: other")]
    lines = grouped(rs).splitlines()
    assert len(lines) == 2 and "×5" in lines[0] and "×1" in lines[1], lines

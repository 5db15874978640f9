"""The manifest's `versions` (bitguard/manifest.py): every installed distribution the script imported,
taken when the recording ends; compare lists version differences first."""

from __future__ import annotations

import json
import sys

import bitguard
from bitguard import manifest
from bitguard.backend.compare import manifest_differences


def _fake_distribution(root, name="fakelib", version="1.2.3"):
    """An installed distribution `name` (one top-level package) in folder `root`."""
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("VALUE = 1\n")
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{name}\n")


def test_a_distribution_the_script_imports_during_the_run_is_in_the_manifest(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "fake_numerics_lib", "1.2.3")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_numerics_lib", raising=False)
    with bitguard.record(tmp_path / "run", determinism=False):
        import fake_numerics_lib  # noqa: F401 - imported by "the script", after recording began
    versions = json.loads((tmp_path / "run" / "manifest.json").read_text())["versions"]
    assert versions["fake-numerics-lib"] == "1.2.3", versions  # normalized name (PEP 503)
    import torch

    assert versions["torch"] == torch.__version__ and versions["python"]
    manifest.load(tmp_path / "run")  # and the manifest validates


def test_a_distribution_installed_while_the_process_runs_is_found(tmp_path, monkeypatch):
    """Which distribution provides which module is read once per search path (a scan of every
    installed distribution): one installed into a folder already on the path is found all the same."""
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "late_lib" not in manifest.distribution_owners()
    _fake_distribution(tmp_path, "late_lib", "0.4")
    monkeypatch.delitem(sys.modules, "late_lib", raising=False)
    import late_lib  # noqa: F401

    assert manifest.distribution_owners()["late_lib"] == ["late-lib"]
    assert manifest.versions()["late-lib"] == "0.4"


def test_a_library_not_imported_is_not_listed(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "never_imported_lib")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "never-imported-lib" not in manifest.versions()


def test_a_failure_to_read_versions_keeps_the_start_and_ends_the_recording(monkeypatch):
    def broken():
        raise RuntimeError("metadata unreadable")

    monkeypatch.setattr(manifest, "versions", broken)
    assert manifest.versions_at_end({"torch": "2.13.0"}) == {"torch": "2.13.0"}


def test_an_old_manifest_with_few_versions_still_loads(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    manifest.write(run, {"tool": "bitguard", "schema_version": 1, "world_size": 1,
                         "versions": {"python": "3.11.7", "torch": "2.5.0", "numpy": "1.26.4"}})
    assert manifest.load(run)["versions"]["torch"] == "2.5.0"


def test_version_differences_come_first_those_both_runs_imported_before_the_rest():
    a = {"versions": {"torch": "2.13.0", "transformers": "5.24.0", "httpx": "1.0"}, "world_size": 1,
         "devices": ["cpu"]}
    b = {"versions": {"torch": "2.13.0", "transformers": "4.46.3", "requests": "2.3"}, "world_size": 2,
         "devices": ["cpu"]}
    fields = [d["field"] for d in manifest_differences(a, b)]
    assert fields == ["versions.transformers", "versions.httpx", "versions.requests", "world_size"], fields


def test_the_report_prints_version_differences_first_and_one_line_for_imports_of_one_run():
    from bitguard.backend.report import _manifest_diffs
    from bitguard.backend.result import CompareResult, ManifestDiff

    a = {"versions": {"transformers": "5.24.0", **{f"lib{i}": "1" for i in range(9)}}, "world_size": 1}
    b = {"versions": {"transformers": "4.46.3"}, "world_size": 2}
    diffs = [ManifestDiff(**d) for d in manifest_differences(a, b)]
    lines = _manifest_diffs(CompareResult.model_construct(manifest_diffs=diffs))
    assert lines[1].startswith("  • versions.transformers: A='5.24.0'  B='4.46.3'"), lines
    assert lines[2].startswith("  • world_size"), lines
    assert lines[3].startswith("  • imported by one run only: lib0 1 (A), ") and "and 3 more (--json lists them)" in lines[3]


def test_a_killed_run_that_never_listed_its_imports_differs_only_in_what_both_list():
    """The script's imports are listed when the recording ends: a run killed before that (a
    status, its end time null as the start wrote it) lacks them, which is no difference in the
    libraries; a version both list still is."""
    a = {"versions": {"torch": "2.13.0", "numpy": "2.4.6", "duckdb": "2.0.1", "polars": "2.1.0"}, "world_size": 1,
         "status": "complete", "end_time": "2026-12-04T23:30:00+0000"}
    b = {"versions": {"torch": "2.13.0", "numpy": "2.3.0"}, "world_size": 1, "status": "failed", "end_time": None}
    assert [d["field"] for d in manifest_differences(a, b)] == ["versions.numpy"]
    assert [d["field"] for d in manifest_differences(b, a)] == ["versions.numpy"]
    b["end_time"] = "2026-12-04T23:31:00+0000"  # ended: what it lacks, it did not import
    assert [d["field"] for d in manifest_differences(a, b)] == ["versions.numpy", "versions.duckdb", "versions.polars"]


def test_runs_recorded_by_different_builds_of_bitguard_say_so():
    """Helper 32: a run recorded before a change of the recorder (a `read` row kind added) and one
    after differed in their API rows with nothing to say why: the tool version of a development
    build does not change. The manifest names the recording code's build; a run without it is unknown."""
    from bitguard.manifest import new, recorder_build

    made = new(["train.py"], "full", 1, {}, None)
    assert made["recorder"] == recorder_build() and len(made["recorder"]) == 16
    a, b = {"recorder": "0" * 16}, {"recorder": "1" * 16}
    assert [(d["field"], d["a"], d["b"]) for d in manifest_differences(a, b)] == [("recorder", "0" * 16, "1" * 16)]
    assert manifest_differences(a, {}) == [] and manifest_differences(a, dict(a)) == []

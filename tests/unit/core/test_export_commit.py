"""benchmarks/export_commit.py: the export of a commit is what `import bitguard` finds with the folder first
on PYTHONPATH, even from the venv whose editable install maps bitguard to this checkout (the "before" of
bench_compare.py and bench_recording.py --before would otherwise time this checkout against itself)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
import export_commit  # noqa: E402


def test_the_export_is_the_bitguard_imported_with_it_first(tmp_path):
    dest = tmp_path / "old"
    package = export_commit.export("HEAD", dest)
    assert (package / "backend" / "compare.py").is_file() and (package / "collectors" / "hooks.py").is_file()
    where = subprocess.run([sys.executable, "-c", "import bitguard.backend.compare as c, bitguard.collectors.hooks as h; "
                            "print(c.__file__); print(h.__file__)"], env={"PYTHONPATH": str(dest)},
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout.split()
    assert all(Path(p).is_relative_to(dest) for p in where), where


def test_a_folder_in_use_or_a_bad_commit_is_refused(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(SystemExit, match="not empty"):
        export_commit.export("HEAD", tmp_path / "full")
    with pytest.raises(SystemExit, match="git archive no-such-commit failed"):
        export_commit.export("no-such-commit", tmp_path / "new")

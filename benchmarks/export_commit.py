"""Export a commit's bitguard as a folder to put first on PYTHONPATH: the "before" of an A/B benchmark.

    python benchmarks/export_commit.py COMMIT DEST
    PYTHONPATH=DEST python -m bitguard ...          # that commit's bitguard, from outside the checkout

DEST gets `bitguard/` laid out as the editable install maps it (the checkout's `bitguard/` with
`backend`, `collectors`, `cuda`, `frontend` and `sample_traces` inside it) and a `sitecustomize.py`
that takes the editable install's finder off `sys.meta_path`, so that `import bitguard` finds the
export even when run from the venv that has this checkout installed. bench_compare.py `--before`,
bench_recording.py `--before` and compare_documents.py read such a folder.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# top-level folders of the checkout that the editable install maps into the `bitguard` package
MAPPED = ("backend", "collectors", "cuda", "frontend", "sample_traces")
SITECUSTOMIZE = (
    "import sys\n"
    "# the editable install's finder would map bitguard to the checkout: the export is wanted instead\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__\n"
    "                    and 'editable' not in getattr(f, '__name__', '')]\n")


def export(commit: str, dest: Path) -> Path:
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"{dest} is not empty: give a new folder")
    try:
        tar = subprocess.run(["git", "archive", commit, "bitguard", *MAPPED], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"git archive {commit} failed: {e.stderr.decode(errors='replace').strip()}") from None
    package = dest / "bitguard"
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        for member in archive.getmembers():
            top, _, rest = member.name.partition("/")
            member.name = member.name if top == "bitguard" else f"bitguard/{top}/{rest}" if rest else f"bitguard/{top}"
            archive.extract(member, dest, filter="data")
    (dest / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return package


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("commit")
    p.add_argument("dest", type=Path)
    args = p.parse_args()
    print(export(args.commit, args.dest))


if __name__ == "__main__":
    main()

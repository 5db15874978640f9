"""Run uploads: a multipart body streamed into a staging folder, each part checked as it arrives.

`receive_run(request, folder, limits)` parses `multipart/form-data` whose file parts are named by
their path inside the run folder (what a browser's directory picker sends), writes each file
under `folder`, and refuses, as a `BadInput` or `TooLarge` naming the part, anything that could
escape the folder, clash with another part, break the file system (over-long names, a path used
both as a file and as a folder) or exceed a size limit. It returns the run directory inside
`folder` and the name of the user's folder. Nothing here knows what a run holds (the workspace
admits it) or how routes are laid out (server.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from bitguard.errors import BadInput, BitguardError, TooLarge

MAX_PART_BYTES = 255  # longest file or folder name most file systems take (bytes, UTF-8)
MAX_PATH_BYTES = 1024  # longest relative path of an uploaded file
MAX_DEPTH = 32  # most folder levels inside an uploaded run
MAX_FIELD_BYTES = 4096  # longest plain form field (the run name)
MAX_FIELDS = 16  # most plain form fields in one upload (it has one: name)

_DRIVE = re.compile(r"^[A-Za-z]:")
_FILENAME = re.compile(rb'filename="((?:[^"\\]|\\.)*)"')


@dataclass
class UploadLimits:
    max_file_bytes: int  # largest single file
    max_run_bytes: int  # all files together
    max_files: int  # most files


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _short(name: str) -> str:
    return repr(name if len(name) <= 80 else name[:60] + "…" + name[-12:])


def safe_relpath(name: str) -> PurePosixPath:
    """The relative path a browser sent for a file, or BadInput if it could escape the folder or
    is not a path this server's file system can hold."""
    if not name or "\x00" in name:
        raise BadInput("an uploaded file has no usable name; upload the run folder with the directory picker")
    if name.startswith(("/", "\\")) or _DRIVE.match(name):
        raise BadInput(f"{_short(name)} is an absolute path; upload files by their path inside the run folder")
    if "\\" in name:
        raise BadInput(f"{_short(name)} contains a backslash; upload files with '/'-separated relative paths")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise BadInput(f"{_short(name)} is not a plain relative path ('..', '.' and empty parts are refused)")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES or len(parts) > MAX_DEPTH:
        raise BadInput(f"{_short(name)} is over {MAX_PATH_BYTES} bytes or {MAX_DEPTH} folders deep; "
                       "a run folder holds manifest.json and rank-N.duckdb files: is this the run folder?")
    long = next((p for p in parts if len(p.encode("utf-8", "surrogatepass")) > MAX_PART_BYTES), None)
    if long is not None:
        raise BadInput(f"{_short(name)}: the name {_short(long)} is over {MAX_PART_BYTES} bytes, longer than "
                       "a file system holds; rename it or leave it out of the upload")
    return PurePosixPath(*parts)


@dataclass
class _Tree:
    """The paths received so far: a path may be a file or a folder, never both."""

    files: set = field(default_factory=set)
    folders: set = field(default_factory=set)

    def add(self, rel: PurePosixPath) -> None:
        if rel in self.files:
            raise BadInput(f"{rel} is uploaded twice; upload one run folder at a time")
        if rel in self.folders:
            raise BadInput(f"{rel} is uploaded as a file and is also a folder of other uploaded files; "
                           "upload one run folder at a time")
        for parent in rel.parents:
            if parent in self.files:
                raise BadInput(f"{parent} is uploaded as a file and is also the folder of {rel}; "
                               "upload one run folder at a time")
        self.files.add(rel)
        self.folders.update(p for p in rel.parents if p != PurePosixPath("."))


class _Receiver:
    """Multipart callbacks that write each file part under `folder`, enforcing the limits."""

    def __init__(self, folder: Path, limits: UploadLimits):
        self.folder = folder
        self.limits = limits
        self.fields: dict[str, str] = {}
        self.tree = _Tree()
        self.paths: list[PurePosixPath] = []
        self.total = 0
        self._headers: dict[str, bytes] = {}
        self._field = b""
        self._value = b""
        self._file = None
        self._file_name = ""
        self._file_size = 0
        self._text: bytearray | None = None
        self._text_name = ""

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda d, s, e: self._add("_field", d[s:e]),
            "on_header_value": lambda d, s, e: self._add("_value", d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._data,
            "on_part_end": self._part_end,
        }

    def _add(self, attr: str, data: bytes) -> None:
        if len(getattr(self, attr)) + len(data) > 16384:
            raise BadInput("a multipart header is over 16 KiB; upload the run folder from the browser or with curl -F")
        setattr(self, attr, getattr(self, attr) + data)

    def _part_begin(self) -> None:
        self._headers = {}

    def _header_end(self) -> None:
        self._headers[self._field.decode("latin-1").lower()] = self._value
        self._field = self._value = b""

    def _headers_finished(self) -> None:
        disposition = self._headers.get("content-disposition", b"")
        _, options = parse_options_header(disposition)
        field_name = options.get(b"name", b"").decode("utf-8", "replace")
        raw = _FILENAME.search(disposition)  # read raw: parse_options_header drops "C:\" prefixes
        if raw is None and b"filename=" not in disposition:
            if len(self.fields) >= MAX_FIELDS:
                raise BadInput(f"the upload has more than {MAX_FIELDS} form fields; send the run's files and "
                               "at most a name")
            self._text, self._text_name = bytearray(), field_name
            return
        name = raw.group(1).decode("utf-8", "replace") if raw else ""
        name = name.replace('\\"', '"').replace("%22", '"')
        rel = safe_relpath(name)
        if len(self.paths) >= self.limits.max_files:
            raise BadInput(f"a run upload may hold at most {self.limits.max_files} files (BITGUARD_MAX_FILES); "
                           "is this the run folder?")
        self.tree.add(rel)
        target = self.folder.joinpath(*rel.parts)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(target, "xb")  # noqa: SIM115 - closed in _part_end or close()
        except OSError as exc:
            raise BadInput(f"{rel} cannot be stored ({exc.strerror or type(exc).__name__}); rename it or "
                           "leave it out of the upload") from None
        self.paths.append(rel)
        self._file_name, self._file_size = str(rel), 0

    def _data(self, data: bytes, start: int, end: int) -> None:
        n = end - start
        if self._file is not None:
            self._file_size += n
            self.total += n
            if self._file_size > self.limits.max_file_bytes:
                raise TooLarge(f"{self._file_name} is over the {human(self.limits.max_file_bytes)} per-file limit; "
                               "start the server with a larger BITGUARD_MAX_FILE_BYTES or compare these runs "
                               "with `bitguard compare`")
            if self.total > self.limits.max_run_bytes:
                raise TooLarge(f"this run is over the {human(self.limits.max_run_bytes)} per-run upload limit; "
                               "start the server with a larger BITGUARD_MAX_RUN_BYTES or compare it with "
                               "`bitguard compare` on the machine that holds it")
            self._file.write(data[start:end])
        elif self._text is not None:
            if len(self._text) + n > MAX_FIELD_BYTES:
                raise BadInput(f"form field {_short(self._text_name)} is over 4 KiB")
            self._text += data[start:end]

    def _part_end(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        elif self._text is not None:
            self.fields[self._text_name] = self._text.decode("utf-8", "replace")
            self._text = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _run_root(folder: Path, paths: list[PurePosixPath]) -> tuple[Path, str | None]:
    """The uploaded run directory: the folder itself, or the one folder every path sits in."""
    if not paths:
        raise BadInput("the upload holds no files; pick a run folder (it holds manifest.json and rank-N.duckdb)")
    if (folder / "manifest.json").is_file():
        return folder, None
    tops = {p.parts[0] for p in paths}
    if len(tops) == 1 and all(len(p.parts) > 1 for p in paths):
        top = tops.pop()
        return folder / top, top
    return folder, None


async def drain(request: Request, limit: int) -> None:
    """Read what is left of a refused body (up to `limit` bytes) so the browser sees the answer."""
    seen = 0
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > limit:
                return
    except (ClientDisconnect, RuntimeError):
        return


@dataclass
class Received:
    root: Path  # the run directory inside the staging folder
    folder: str | None  # the name of the user's folder, when every file sat in one
    fields: dict[str, str]  # plain form fields (name)


async def receive_run(request: Request, folder: Path, limits: UploadLimits) -> Received:
    """Stream a multipart run upload into `folder`; BadInput/TooLarge for anything refused."""
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise BadInput("upload a run as multipart/form-data, one part per file named by its relative path")
    try:
        length = int(request.headers.get("content-length") or 0)
    except ValueError:
        raise BadInput("the Content-Length header is not a number") from None
    if length > limits.max_run_bytes + 1_000_000:
        await drain(request, limits.max_run_bytes)
        raise TooLarge(f"this upload ({human(length)}) is over the {human(limits.max_run_bytes)} per-run limit; "
                       "start the server with a larger BITGUARD_MAX_RUN_BYTES or compare it with "
                       "`bitguard compare` on the machine that holds it")
    receiver = _Receiver(folder, limits)
    try:
        parser = MultipartParser(params[b"boundary"], receiver.callbacks())
        async for chunk in request.stream():
            await run_in_threadpool(parser.write, chunk)
        parser.finalize()
    except ClientDisconnect:
        raise BadInput("the upload was interrupted; nothing was kept, upload the run again") from None
    except FormParserError as exc:
        raise BadInput(f"the upload is not well-formed multipart/form-data ({exc}); "
                       "upload the run folder from the browser or with curl -F") from None
    except BitguardError:
        receiver.close()
        await drain(request, limits.max_run_bytes * 2)
        raise
    finally:
        receiver.close()
    root, top = _run_root(folder, receiver.paths)
    return Received(root, top, receiver.fields)

"""One exception family for bitguard.

Every message says what was wrong and what to do about it, on one line. The CLI turns a
`BitguardError` into that line on stderr and exit status 2; the web app turns it into one JSON
error shape (`{"error": {"type": ..., "message": ...}}`).
"""


class BitguardError(Exception):
    """Base of every error bitguard raises on purpose. `exit_code` is what the CLI exits with."""

    exit_code = 2
    http_status = 400

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class BadInput(BitguardError):
    """A command-line argument, path or option that cannot be used."""


class NotARun(BitguardError):
    """A folder (or upload) that is not a bitguard run directory."""


class SchemaMismatch(BitguardError):
    """A run recorded with an unknown or newer schema version."""


class CorruptRun(BitguardError):
    """A rank file that cannot be read (truncated, not DuckDB, missing tables)."""


class IncompatibleRuns(BitguardError):
    """Two runs that cannot be compared (different world sizes, no common rank)."""


class RulesError(BitguardError):
    """A benign-difference rules file or rule that is not valid."""


class NotSupported(BitguardError):
    """Something bitguard does not do yet; the message says what instead."""


class NotFound(BitguardError):
    """A run, comparison, rule set or event that does not exist."""

    http_status = 404


class ComparisonNotReady(BitguardError):
    """A comparison that is still being computed (or failed); poll its summary."""

    http_status = 409


class TooLarge(BadInput):
    """An upload over a size limit."""

    http_status = 413

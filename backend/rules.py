"""Benign-difference rules: what a user has decided does not count as a divergence.

A rules file is JSON:

    {"schema": "bitguard.rules/1",
     "rules": [{"id": "dropout-p0", "action": "allow-gap",
                "match": {"boundary": "blocks.*.mlp.act.*", "phase": "forward"},
                "note": "inserted Dropout(p=0) helper", "author": "ana", "created": "2026-11-29"}]}

`match` fields (all optional, all must hold): boundary (fnmatch glob on the dotted path),
module_type (glob), phase, role (ignore rules: the tensor role whose difference is benign),
path (ignore rules: glob on the tensor's path in its event, `['config']['init_from'] (python str)`),
dtype, steps ([first, last] inclusive, either may be null), rank. Actions: `ignore` (a digest
difference on a matching tensor is not a divergence) and `allow-gap` (a matching event present
on one side only is expected). An `ignore` rule whose phase is `read` matches instead a value the
training read out of a tensor (`.item()`, `float()`, `tolist()`): boundary globs what read it
(`item`), path its place (`trainer.py:2379`); no other rule matches one. This module validates
and matches; it does not compare runs.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from bitguard.errors import RulesError
from bitguard.schema import PHASES, ROLES

RULES_SCHEMA = "bitguard.rules/1"
READ = "read"  # the phase of an ignore rule for a value read out of a tensor (`RuleSet.read_rule`)
ACTIONS = ("ignore", "allow-gap")
MATCH_FIELDS = ("boundary", "module_type", "phase", "role", "path", "dtype", "steps", "rank")
RULE_FIELDS = ("id", "match", "action", "note", "author", "created")
_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,80}$")
MAX_RULES_BYTES = 8 << 20  # a rules file larger than this is not a rules file
MAX_DEPTH = 32  # a rule is at most four levels deep; deeper nesting is refused before json.loads recurses


def parse_json(text: str, what: str):
    """`json.loads(text)` for a rules document, refused in one line when it is not JSON or nested
    deeper than any rules file (json.loads would recurse until Python's stack limit)."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise RulesError(f"{what} nests deeper than {MAX_DEPTH} levels; a rules file is "
                                 f"{{\"schema\", \"rules\": [...]}}")
        elif ch in "]}":
            depth -= 1
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RulesError(f"{what} is not valid JSON (line {exc.lineno}: {exc.msg}); fix it") from None
    except RecursionError:
        raise RulesError(f"{what} nests too deeply to be a rules file") from None


@dataclass(frozen=True)
class Rule:
    id: str  # unique within the rule set; letters, digits, _ . : -
    action: str  # ignore | allow-gap
    match: dict = field(default_factory=dict)  # the match fields above
    note: str = ""  # why this difference is benign
    author: str = ""  # who decided
    created: str = ""  # when (ISO date)

    def matches(self, *, boundary: str, module_type: str, phase: str, step: int, rank: int,
                role: str | None = None, dtype: str | None = None, path: str | None = None) -> bool:
        m = self.match
        if "boundary" in m and not fnmatch.fnmatchcase(boundary, m["boundary"]):
            return False
        if "module_type" in m and not fnmatch.fnmatchcase(module_type or "", m["module_type"]):
            return False
        if "phase" in m and phase != m["phase"]:
            return False
        if "rank" in m and rank != m["rank"]:
            return False
        if "steps" in m:
            first, last = m["steps"]
            if (first is not None and step < first) or (last is not None and step > last):
                return False
        if role is not None and "role" in m and role != m["role"]:
            return False
        if dtype is not None and "dtype" in m and dtype != m["dtype"]:
            return False
        if "path" in m and (path is None or not fnmatch.fnmatchcase(path, m["path"])):
            return False
        return True

    def to_dict(self) -> dict:
        return {"id": self.id, "match": dict(self.match), "action": self.action, "note": self.note,
                "author": self.author, "created": self.created}


def _check_rule(raw, position: int) -> Rule:
    where = f"rule #{position + 1}"
    if not isinstance(raw, dict):
        raise RulesError(f"{where} is not an object; each rule is {{\"id\", \"match\", \"action\", ...}}")
    rid = raw.get("id")
    if not isinstance(rid, str) or not _ID.match(rid):
        raise RulesError(f"{where}: field 'id' must be a short name of letters, digits, _ . : - (got {rid!r})")
    where = f"rule {rid!r}"
    unknown = set(raw) - set(RULE_FIELDS)
    if unknown:
        raise RulesError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(RULE_FIELDS)}")
    action = raw.get("action")
    if action not in ACTIONS:
        raise RulesError(f"{where}: field 'action' must be one of {', '.join(ACTIONS)} (got {action!r})")
    match = raw.get("match", {})
    if not isinstance(match, dict):
        raise RulesError(f"{where}: field 'match' must be an object of {', '.join(MATCH_FIELDS)}")
    unknown = set(match) - set(MATCH_FIELDS)
    if unknown:
        raise RulesError(f"{where}: unknown match field(s) {', '.join(sorted(unknown))}; "
                         f"allowed: {', '.join(MATCH_FIELDS)}")
    for key in ("boundary", "module_type", "dtype", "path"):
        if key in match and not isinstance(match[key], str):
            raise RulesError(f"{where}: match.{key} must be a string (got {match[key]!r})")
    if "phase" in match and match["phase"] not in PHASES + (READ,):
        raise RulesError(f"{where}: match.phase must be one of {', '.join(PHASES + (READ,))} (got {match['phase']!r})")
    if match.get("phase") == READ and action != "ignore":
        raise RulesError(f"{where}: match.phase 'read' (a value read out of a tensor) applies to 'ignore' rules only")
    if match.get("phase") == READ and set(match) - {"phase", "boundary", "path", "steps", "rank"}:
        raise RulesError(f"{where}: a rule for a value read out of a tensor matches boundary (what read it: item), "
                         f"path (its place: file.py:LINE), steps and rank only; remove "
                         f"{', '.join(sorted(set(match) - {'phase', 'boundary', 'path', 'steps', 'rank'}))}")
    if "role" in match and match["role"] not in ROLES:
        raise RulesError(f"{where}: match.role must be one of {', '.join(ROLES)} (got {match['role']!r})")
    if "rank" in match and (not isinstance(match["rank"], int) or isinstance(match["rank"], bool)):
        raise RulesError(f"{where}: match.rank must be an integer (got {match['rank']!r})")
    if "steps" in match:
        steps = match["steps"]
        ok = (isinstance(steps, list) and len(steps) == 2
              and all(s is None or (isinstance(s, int) and not isinstance(s, bool) and s >= 0) for s in steps))
        if not ok or (None not in steps and steps[0] > steps[1]):
            raise RulesError(f"{where}: match.steps must be [first, last] with 0 <= first <= last (null for open), "
                             f"got {steps!r}")
    for key in ("role", "path"):
        if action == "allow-gap" and key in match:
            raise RulesError(f"{where}: match.{key} applies to 'ignore' rules only; remove it from this allow-gap rule")
    for key in ("note", "author", "created"):
        if key in raw and not isinstance(raw[key], str):
            raise RulesError(f"{where}: field '{key}' must be a string")
    return Rule(rid, action, dict(match), raw.get("note", ""), raw.get("author", ""), raw.get("created", ""))


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...] = ()

    @classmethod
    def from_dict(cls, data) -> RuleSet:
        if not isinstance(data, dict):
            raise RulesError("a rules file is a JSON object {\"schema\": \"bitguard.rules/1\", \"rules\": [...]}")
        schema = data.get("schema", RULES_SCHEMA)
        if schema != RULES_SCHEMA:
            raise RulesError(f"rules schema {schema!r} is not supported; this bitguard reads {RULES_SCHEMA!r}")
        raw = data.get("rules", [])
        if not isinstance(raw, list):
            raise RulesError("field 'rules' must be a list of rules")
        rules = tuple(_check_rule(r, i) for i, r in enumerate(raw))
        seen = set()
        for r in rules:
            if r.id in seen:
                raise RulesError(f"rule {r.id!r}: field 'id' is used twice; give each rule its own id")
            seen.add(r.id)
        return cls(rules)

    @classmethod
    def load(cls, source) -> RuleSet:
        """From None, a RuleSet, a dict, or a path to a rules file."""
        if source is None:
            return cls()
        if isinstance(source, RuleSet):
            return source
        if isinstance(source, dict):
            return cls.from_dict(source)
        path = Path(source)
        try:
            if not path.is_file():
                raise RulesError(f"rules file {path} is not a regular file; give the path of a bitguard.rules/1 "
                                 f"JSON file to --rules")
            if path.stat().st_size > MAX_RULES_BYTES:
                raise RulesError(f"rules file {path} is {path.stat().st_size} bytes, over the {MAX_RULES_BYTES} a "
                                 f"rules file may have; is it the right file?")
            raw = path.read_bytes()
        except OSError as exc:
            raise RulesError(f"cannot read rules file {path}: {exc.strerror or exc}; check the --rules path") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RulesError(f"rules file {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8 JSON") from None
        return cls.from_dict(parse_json(text, f"rules file {path}"))

    def to_dict(self) -> dict:
        return {"schema": RULES_SCHEMA, "rules": [r.to_dict() for r in self.rules]}

    def read_rule(self, target: str, at: str | None, step: int, rank: int) -> Rule | None:
        """The first `ignore` rule of phase `read` that accepts a value read by `target` (`item`) at place
        `at` (`file.py:LINE`) in step `step` of rank `rank` that differs between the runs; None if none."""
        for rule in self.rules:
            if rule.match.get("phase") == READ and rule.matches(boundary=target, module_type="", phase=READ,
                                                              step=step, rank=rank, path=at):
                return rule
        return None

    def of(self, action: str) -> list[Rule]:
        return [r for r in self.rules if r.action == action]

"""Online mode (`bitguard record --mode online`): sensors on the critical path, a verifier off it,
alerts in the run directory. See monitor.py for the whole, sensor.py for the interface a sensor
implements; a new sensor is one file plus one line in SENSORS."""

from __future__ import annotations

import importlib

from bitguard.errors import BadInput

# name -> "module:class" (imported when selected). A new sensor: its file, and one line here.
SENSORS = {
    "checksum": "bitguard.collectors.online.checksum:ChecksumSensor",
    "recompute": "bitguard.collectors.online.recompute_sensor:RecomputeSensor",
    "crossrank": "bitguard.collectors.online.crossrank:CrossRankSensor",
    "guard": "bitguard.collectors.online.guards:GuardSensor",
}


def parse_sensors(text: str | list | tuple | None) -> list[str]:
    """The sensor names `--sensors a,b` selects (None or "all": every registered one)."""
    if text is None or text == "all":
        return list(SENSORS)
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    unknown = [n for n in names if n not in SENSORS]
    if unknown or not names:
        raise BadInput(f"unknown sensor(s) {', '.join(unknown) or '(none given)'} in --sensors; "
                       f"use a comma-separated list of: {', '.join(SENSORS)}")
    return list(dict.fromkeys(names))


def build(names: list[str]) -> list:
    """One instance of each named sensor."""
    out = []
    for name in names:
        module, _, cls = SENSORS[name].partition(":")
        out.append(getattr(importlib.import_module(module), cls)())
    return out

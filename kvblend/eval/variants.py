"""Blend settings named on a command line: `--variant "stale_key_scale=0.5 check_candidates=0"` or a
grid `stale_key_scale=1,0.5` -> dicts of BlendConfig fields. Shared by blend_phases.py and the
scripts under experiments/."""

from __future__ import annotations

import itertools


def parse_grid(items: list[str]) -> list[dict]:
    """["stale_key_scale=1,0.5", "deviation=k,v"] -> every combination, as BlendConfig fields.
    List fields take one item or several joined by "+": check_layers=0,1+6."""
    axes = []
    for item in items:
        name, _, values = item.partition("=")
        as_list = name in ("check_layers", "ratios")
        parse = (lambda v: _listed(_value(v))) if as_list else str if name == "deviation" else _value
        axes.append([(name, parse(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def _listed(value):
    return value if isinstance(value, list) else [value]


def _value(text: str):
    if "+" in text:  # a list field: check_layers=1+6
        return [_value(t) for t in text.split("+")]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)

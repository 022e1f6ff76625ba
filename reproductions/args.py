"""argparse value types the reproduction commands share: a bad value is refused naming the rule it breaks."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def key_value(text: str, flag: str) -> tuple[str, bool | int | str]:
    """KEY=VALUE -> (key, value): true/false (any case) as bools, integers as ints, anything else as the string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{flag} takes KEY=VALUE, got {text!r}")
    low = value.lower()
    if low in ("true", "false"):
        return key, low == "true"
    try:
        return key, int(value)
    except ValueError:
        return key, value

"""Values as people write them in config files and on the command line: sizes ("512MiB", "8GB",
1234) and numbers (where a bool never counts as one, though Python's True is the int 1)."""

from __future__ import annotations

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def is_number(value: object, *, integer: bool = False) -> bool:
    """An int or a float (with `integer`, an int), and not a bool: `true` in TOML or JSON is no number."""
    return isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)


def parse_size(value: int | float | str) -> int:
    """Bytes from 1234, "512MiB", "8GB", "1.5 GiB"."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number):]
    if unit not in _UNITS or not number:
        raise ValueError(f"not a size: {value!r} (use bytes or a unit: KiB, MiB, GiB, MB, GB)")
    return int(float(number) * _UNITS[unit])

"""Sizes given on the command line (``--kv-cache-memory-bytes``), parsed the way vLLM does."""

from __future__ import annotations

import re

from kvroute.errors import UserError

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([a-zA-Z]*)$")
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(text: str | int) -> int:
    """A byte count as vLLM's ``--kv-cache-memory-bytes`` takes it, plus IEC/SI units.

    ``1073741824``; vLLM's own suffixes, upper case binary and lower case decimal (``1G`` =
    2^30, ``1g`` = 10^9, ``64M`` = 64·2^20); ``1GiB``/``64MiB`` (binary) and ``1GB`` (decimal).
    """
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text).strip())
    if not match:
        raise UserError(f"bad size {text!r}: use bytes or a suffix, e.g. 1073741824, 1G, 64M, 1GiB")
    number, unit = match.groups()
    if not unit:
        mult = 1
    elif len(unit) == 1 and unit in _BINARY:
        mult = _BINARY[unit]
    elif len(unit) == 1 and unit in _DECIMAL:
        mult = _DECIMAL[unit]
    elif len(unit) == 3 and unit[1:].lower() == "ib" and unit[0].upper() in _BINARY:
        mult = _BINARY[unit[0].upper()]
    elif len(unit) == 2 and unit[1] == "B" and unit[0].lower() in _DECIMAL:
        mult = _DECIMAL[unit[0].lower()]
    else:
        raise UserError(f"bad size {text!r}: unknown unit {unit!r} (K, M, G, T, KiB, GiB, GB, ...)")
    value = float(number) * mult
    if value != int(value):
        raise UserError(f"bad size {text!r}: not a whole number of bytes")
    return int(value)

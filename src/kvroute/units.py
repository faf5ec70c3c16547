"""Sizes given on the command line: bytes (``--kv-cache-memory-bytes``, parsed the way vLLM
does) and tokens (``--kv-capacity-tokens``)."""

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


_TOKEN_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}


def parse_tokens(text: str | int, flag: str = "--kv-capacity-tokens") -> int:
    """A token count with a decimal suffix, as the paper and operators of large models say it:
    ``3M`` = 3,000,000 tokens, ``500k`` = 500,000, ``1.5G``; a plain integer as is."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text).strip())
        unit = match.group(2).upper() if match else None
        if not match or unit not in _TOKEN_UNITS:
            raise UserError(f"bad {flag} {text!r}: use a token count, e.g. 3000000, 3M, 500K, 1.5G")
        value = float(match.group(1)) * _TOKEN_UNITS[unit]
        if value != int(value):
            raise UserError(f"bad {flag} {text!r}: not a whole number of tokens")
        value = int(value)
    if value < 1:
        raise UserError(f"{flag} must be >= 1 token, got {text!r}")
    return value

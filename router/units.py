"""Byte and time units. GB is decimal (1e9 B), GiB binary (2**30 B); the two differ by 7.4 %."""

from __future__ import annotations

from typing import Final

GB: Final[int] = 1_000_000_000
GiB: Final[int] = 1 << 30
TB: Final[int] = 1_000_000_000_000
MS_PER_S: Final[float] = 1000.0

DTYPE_BYTES: Final[dict[str, float]] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "fp4": 0.5,
}


def dtype_bytes(name: str) -> float:
    """Bytes per element of a dtype name such as ``bf16`` or ``fp8``."""
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ValueError(f"unknown dtype {name!r} (known: {known})") from None


def round_up(value: int, multiple: int) -> int:
    """Round ``value`` up to a multiple (pages, blocks)."""
    if multiple <= 0:
        raise ValueError(f"multiple must be positive, got {multiple}")
    return -(-value // multiple) * multiple


def round_down(value: int, multiple: int) -> int:
    if multiple <= 0:
        raise ValueError(f"multiple must be positive, got {multiple}")
    return (value // multiple) * multiple

"""One named line of a budget: what it is, how many bytes, and the formula a reader can redo."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Term:
    """A named quantity in bytes.

    Attributes:
        name: what it is (``q_norm fp32 copy [T, nq*hd]``).
        bytes: its size in bytes (int).
        formula: the arithmetic with the numbers filled in (``4 * 16384 * 4096``).
    """

    name: str
    bytes: int
    formula: str = ""


def total(terms: list[Term]) -> int:
    """Sum of the terms' bytes."""
    return sum(t.bytes for t in terms)

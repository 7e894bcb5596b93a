"""Reading PromQL text: which of its characters lie outside string literals."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Code:
    """An expression's characters outside strings ("…" and '…' with backslash escapes, `…` raw)."""

    chars: tuple[tuple[int, str], ...]  # (index in the expression, character)
    unclosed_string: bool

    def text(self, length: int) -> str:
        """The expression with every string (quotes included) blanked out, same length."""
        out = [" "] * length
        for i, c in self.chars:
            out[i] = c
        return "".join(out)


def code(expr: str) -> Code:
    """The characters of expr that are PromQL code, not string contents."""
    chars: list[tuple[int, str]] = []
    quote, i = "", 0
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\" and quote != "`":
                i += 1  # an escaped character, the quote included
            elif c == quote:
                quote = ""
        elif c in "\"'`":
            quote = c
        else:
            chars.append((i, c))
        i += 1
    return Code(tuple(chars), bool(quote))

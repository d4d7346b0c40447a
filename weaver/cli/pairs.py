"""`KEY=VALUE` option values, as several `weaver` commands take them."""

from __future__ import annotations


def parse_pairs(values: list[str], flag: str) -> dict[str, str]:
    """{KEY: VALUE} from repeated `flag KEY=VALUE` options; ValueError naming the bad one."""
    out = {}
    for text in values:
        key, sep, value = text.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{flag} {text!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out

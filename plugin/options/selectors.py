"""Label selectors in Kubernetes' syntax, parsed so that a bad one is refused at start with what is wrong where;
the API server applies them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from plugin.validation import is_label_value, is_qualified_name


@dataclass(frozen=True)
class Requirement:
    """One term of a label selector: ``op`` is one of exists, !, =, !=, in, notin."""

    key: str
    op: str
    values: tuple[str, ...] = ()


_SELECTOR_TOKEN = re.compile(r"\s*(?:(!=|==|=|!|\(|\)|,)|([^\s!=(),]+))")


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    pos = 0
    while pos < len(text):
        m = _SELECTOR_TOKEN.match(text, pos)
        if m is None:  # only trailing whitespace is left
            break
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    return out


def parse_selector(text: str) -> tuple[Requirement, ...]:
    """The requirements of a label selector in Kubernetes' syntax (``key``, ``!key``, ``key=value``,
    ``key==value``, ``key!=value``, ``key in (a,b)``, ``key notin (a,b)``, joined by commas); empty selects all.
    Raises ValueError saying what is wrong where."""
    toks = _tokens(text)
    reqs: list[Requirement] = []
    i = 0

    def fail(why: str) -> ValueError:
        return ValueError(f"not a label selector ({why}), got {text!r}")

    def key_at(j: int) -> str:
        if j >= len(toks) or toks[j] in ("!=", "==", "=", "!", "(", ")", ","):
            raise fail("expected a label key" + (f" before {toks[j]!r}" if j < len(toks) else " at the end"))
        if not is_qualified_name(toks[j]):
            raise fail(f"{toks[j]!r} is not a label key")
        return toks[j]

    def value(tok: str) -> str:
        if not is_label_value(tok):
            raise fail(f"{tok!r} is not a label value")
        return tok

    while i < len(toks):
        if toks[i] == "!":
            reqs.append(Requirement(key_at(i + 1), "!"))
            i += 2
        else:
            key = key_at(i)
            i += 1
            op = toks[i] if i < len(toks) else ","
            if op == ",":
                reqs.append(Requirement(key, "exists"))
            elif op in ("=", "==", "!="):
                i += 1
                v = toks[i] if i < len(toks) and toks[i] != "," else ""
                i += 1 if v else 0
                reqs.append(Requirement(key, "!=" if op == "!=" else "=", (value(v),)))
            elif op in ("in", "notin"):
                i += 1
                if i >= len(toks) or toks[i] != "(":
                    raise fail(f"expected '(' after {op}")
                i += 1
                vals: list[str] = []
                # A value may be empty, as in Kubernetes: "in (a,)" is a and "".
                expect_value = True
                while i < len(toks) and toks[i] != ")":
                    if toks[i] == ",":
                        if expect_value:
                            vals.append("")
                        expect_value = True
                    elif expect_value:
                        vals.append(value(toks[i]))
                        expect_value = False
                    else:
                        raise fail(f"expected ',' or ')' before {toks[i]!r}")
                    i += 1
                if i >= len(toks):
                    raise fail(f"missing ')' after {op} (")
                if vals and expect_value:
                    vals.append("")
                if not vals:
                    raise fail(f"'{op}' needs at least one value")
                i += 1
                reqs.append(Requirement(key, op, tuple(vals)))
            else:
                raise fail(f"expected an operator (=, ==, !=, in, notin) or ',' after {key!r}, got {op!r}")
        if i < len(toks):
            if toks[i] != ",":
                raise fail(f"expected ',' before {toks[i]!r}")
            i += 1
            if i >= len(toks):
                raise fail("a ',' with nothing after it")
    return tuple(reqs)

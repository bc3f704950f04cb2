"""docs/remediation.md's table of `eks` reasons is the table the plugin uses (plugin/outlets/condition_reasons.py),
and its recipes are the files the tests check."""

from __future__ import annotations

import re
from pathlib import Path

from plugin.health.reasons import SPECS, Action, Reason, Source, State
from plugin.outlets.condition_reasons import EKS_GENERIC, EKS_NAMES, condition_reason

DOC = Path(__file__).resolve().parents[2] / "docs" / "remediation.md"


def eks_table() -> list[tuple[list[str], str, str]]:
    """(codes in backticks, the row's first cell, the eks reason) for each row under the eks-reasons marker."""
    text = DOC.read_text().split("<!-- eks-reasons -->", 1)[1]
    rows = []
    for line in text.strip().splitlines()[2:]:
        if not line.startswith("|"):
            break
        first, name = (c.strip() for c in line.strip("|").split("|"))
        rows.append((re.findall(r"`([^`]+)`", first), first, name.strip("`")))
    return rows


def test_the_documented_eks_names_are_the_plugins() -> None:
    documented: dict[str, str] = {}
    for codes, _, name in eks_table():
        for code in codes:
            if code in SPECS:
                documented[code] = name
    assert documented == EKS_NAMES


def test_the_documented_xid_and_generic_rows_hold() -> None:
    rows = {first: name for _, first, name in eks_table()}

    def reason(code: str, severity: State) -> Reason:
        return Reason(code, severity, "", Source.EVENT, Action.RESET_GPU, 0.0)

    error, warning = (name for first, name in rows.items() if first.startswith(("`xid-<n>`", "the same")))
    assert error.replace("<n>", "48") == condition_reason("eks", "False", reason("xid-48", State.UNHEALTHY))
    assert warning.replace("<n>", "13") == condition_reason("eks", "False", reason("xid-13-repeated", State.DEGRADED))
    generic = {first: name for first, name in rows.items() if "status" in first}
    assert sorted(generic.values()) == sorted(EKS_GENERIC.values())
    for first, name in generic.items():
        status = re.findall(r"status `(\w+)`", first)[0]
        assert EKS_GENERIC[status] == name


def test_the_recipes_named_exist() -> None:
    for path in re.findall(r"`(docs/recipes/[^`]+)`", DOC.read_text()):
        assert (DOC.parents[1] / path).is_file(), path

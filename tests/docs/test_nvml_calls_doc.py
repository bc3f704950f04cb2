"""docs/nvml-calls.md against the NVML backend: every call the backend makes has a row, every row is a call it makes,
and every answer is sorted as the table says."""

from __future__ import annotations

import re
from pathlib import Path

from plugin.devices import nvml

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "nvml-calls.md").read_text()
CODE = Path(nvml.__file__).read_text()


def _table(heading: str) -> list[list[str]]:
    section = DOC.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def test_every_call_the_backend_makes_has_a_row_and_every_row_is_made() -> None:
    made = set(re.findall(r'"(nvml(?:Device|System|Event|Shutdown)[A-Za-z0-9_]*)"', CODE))
    documented = {row[0].strip("`") for row in _table("Calls")}
    assert made - documented == set(), "calls without a row in docs/nvml-calls.md"
    assert documented - made == set(), "rows for calls the backend no longer makes"


def test_every_answer_is_sorted_as_documented() -> None:
    rows = {int(row[0]): (row[1].strip("`"), row[2], row[3]) for row in _table("Answers")}
    assert set(rows) == set(nvml.ANSWERS)
    for code, (kind, meaning) in nvml.ANSWERS.items():
        assert rows[code][1:] == (kind, meaning), code
        assert getattr(nvml, "ERR_" + rows[code][0], nvml.SUCCESS if code == 0 else None) == code
    assert {c for c, (k, _) in nvml.ANSWERS.items() if k == "absent"} == nvml.ABSENT

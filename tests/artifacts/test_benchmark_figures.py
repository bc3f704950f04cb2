"""The memory figures the deployment docs and manifests state are the benchmark record's, docs/benchmarks.json.

The convention: a measured figure is written next to the record entry it comes from,

    44.4 MiB (benchmarks.json "RSS after start, 8 simulated GPUs, defaults")

that is a number, ``MiB``, and in parentheses ``benchmarks.json`` with the entry's ``metric`` in double quotes (in a
YAML comment it may wrap onto the next comment line). The test finds every such citation and compares the number
with the entry's ``result``, in MiB. Where the figures are stated, every other ``N MiB`` is an error, so a figure
cannot be added or left behind without its source:

- docs/deploy.md: each table cell or sentence that speaks of RSS;
- the comment block above each ``resources:`` in manifests/ and in the chart's values.yaml.

Quantities in Kubernetes' own spelling (``80Mi``, ``256Mi``) are settings, not figures, and are not matched. When
bench/run_all.py writes a new record, this test names every figure that went stale."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / "docs" / "benchmarks.json"
DEPLOY = REPO / "docs" / "deploy.md"
VALUES = REPO / "charts" / "gpu-health-device-plugin" / "values.yaml"
CITED = re.compile(r'(\d+(?:\.\d+)?) MiB \(benchmarks\.json "([^"]+)"\)')
FIGURE = re.compile(r"\b\d+(?:[.,]\d+)? ?MiB\b")


def record() -> dict[str, dict[str, object]]:
    return {e["metric"]: e for e in json.loads(RECORD.read_text())}


def resource_comments(path: Path) -> list[tuple[str, str]]:
    """(where, the comment block above a ``resources:`` key, its lines joined by one space) for one YAML file."""
    lines = path.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if re.fullmatch(r"\s*resources:\s*", line):
            j = i
            while j > 0 and lines[j - 1].lstrip().startswith("#"):
                j -= 1
            text = " ".join(ln.strip().lstrip("#").strip() for ln in lines[j:i])
            blocks.append((f"{path.relative_to(REPO)}:{i + 1}", text))
    return blocks


def deploy_segments() -> list[tuple[str, str]]:
    """The table cells and sentences of docs/deploy.md that speak of RSS, with their line numbers."""
    out = []
    for n, line in enumerate(DEPLOY.read_text().splitlines(), 1):
        for part in re.split(r"\|", line):
            for sentence in re.split(r"(?<=[.;])\s+(?=[A-Z(`])", part):
                if "RSS" in sentence:
                    out.append((f"docs/deploy.md:{n}", sentence))
    return out


def checked_texts() -> list[tuple[str, str]]:
    texts = deploy_segments()
    for path in [*sorted((REPO / "manifests").rglob("*.yaml")), VALUES]:
        texts += resource_comments(path)
    return texts


def problems(texts: list[tuple[str, str]], entries: dict[str, dict[str, object]]) -> list[str]:
    found = []
    for where, text in texts:
        for figure, metric in CITED.findall(text):
            entry = entries.get(metric)
            if entry is None:
                found.append(f"{where}: no entry {metric!r} in docs/benchmarks.json")
            elif entry["unit"] != "MiB" or float(figure) != entry["result"]:
                found.append(f"{where}: {figure} MiB, but the record says {entry['result']} {entry['unit']} "
                             f"for {metric!r}")
        for bare in FIGURE.findall(CITED.sub("", text)):
            found.append(f"{where}: {bare!r} cites no entry of docs/benchmarks.json")
    return found


def test_every_stated_memory_figure_is_the_records() -> None:
    assert problems(checked_texts(), record()) == []


@pytest.mark.parametrize("where", ["docs/deploy.md", "manifests/base/daemonset.yaml",
                                   "manifests/components/controller/deployment.yaml",
                                   "charts/gpu-health-device-plugin/values.yaml"])
def test_the_sizing_texts_cite_the_record(where: str) -> None:
    # Without this, deleting every figure would pass: each place that sizes a container says what it was sized by.
    cited = [t for w, t in checked_texts() if w.startswith(where + ":") and CITED.search(t)]
    assert cited, f"{where} states no figure from docs/benchmarks.json"


def test_a_stale_or_uncited_figure_is_named() -> None:
    entries = {"RSS x": {"metric": "RSS x", "result": 44.4, "unit": "MiB"}}
    texts = [("a", 'RSS 44.4 MiB (benchmarks.json "RSS x")'), ("b", 'RSS 48 MiB (benchmarks.json "RSS x")'),
             ("c", "RSS 59 MiB with reporting on"), ("d", 'RSS 1 MiB (benchmarks.json "RSS y")')]
    assert problems(texts, entries) == [
        "b: 48 MiB, but the record says 44.4 MiB for 'RSS x'",
        "c: '59 MiB' cites no entry of docs/benchmarks.json",
        "d: no entry 'RSS y' in docs/benchmarks.json"]


def test_comment_blocks_are_read_across_wrapped_lines() -> None:
    f = REPO / "manifests" / "base" / "daemonset.yaml"
    blocks = [t for _, t in resource_comments(f)]
    assert any('(benchmarks.json "RSS after start, 8 simulated GPUs, defaults")' in t for t in blocks), blocks

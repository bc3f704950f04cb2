"""The demo, as a user sees it: the frames of the live view (in-process, output captured) and the plain output of the
real command. What it must show: the state the script ended in (not the shutdown that follows), and in every frame
the events that had already happened."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from plugin.devtools.demo import CLEAR, Demo

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FINISHED = "demo finished: every step behaved as expected"


@dataclass
class Frame:
    header: str
    rows: dict[int, tuple[str, str]]  # GPU index -> (state, kubelet health)
    events: list[str]


def parse_frame(text: str) -> Frame:
    lines = ANSI.sub("", text).splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("IDX"))
    rows: dict[int, tuple[str, str]] = {}
    for ln in lines[start + 1:]:
        if not ln.strip():
            break
        idx, _dev, state, kubelet = ln.split()[:4]
        rows[int(idx)] = (state, kubelet)
    events: list[str] = []
    if "Events:" in lines:
        events = [ln for ln in lines[lines.index("Events:") + 1:] if ln.startswith("[")]
    return Frame(next(ln for ln in lines if "capacity=" in ln), rows, events)


def assert_final_state(frame: Frame) -> None:
    """What the script leaves: GPU 5 latched Unhealthy (the only one the kubelet may not allocate), GPU 1 Degraded,
    the rest recovered."""
    assert "capacity=8 allocatable=7" in frame.header and "registrations=2" in frame.header
    assert frame.rows[5] == ("Unhealthy", "Unhealthy")
    assert frame.rows[1] == ("Degraded", "Healthy")
    assert all(frame.rows[i] == ("Healthy", "Healthy") for i in (0, 2, 3, 4, 6, 7)), frame.rows


def test_live_view_starts_with_history_and_ends_on_the_final_state(short_socket_dir: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    demo = Demo(short_socket_dir, duration_s=2.0, plain=False)
    assert demo.run() == 0
    out = capsys.readouterr().out
    body, _, tail = out.rpartition("\n" + FINISHED)
    assert tail.strip() == ""
    frames = [parse_frame(f) for f in body.split(CLEAR)[1:]]
    assert len(frames) >= 2
    first, last = frames[0], frames[-1]
    # The first frame already lists what had happened when it was drawn: the registration it shows.
    assert "capacity=8 allocatable=8" in first.header and "registrations=1" in first.header
    assert any("plugin registered" in e for e in first.events), first.events
    # Every frame shows the latest events up to its moment (the view keeps the last 12), never an empty list,
    # and frames move forward through the log.
    ends = []
    for f in frames:
        assert f.events, "a frame with no events"
        end = demo.log.index(f.events[-1])
        assert f.events == demo.log[max(0, end - 11):end + 1]
        ends.append(end)
    assert ends == sorted(ends)
    # The last frame is the end of the script, not the shutdown after it.
    assert_final_state(last)
    assert "Allocate(GPU 5) -> FAILED_PRECONDITION" in last.events[-1]
    assert demo.log[-1] == last.events[-1]


def test_plain_demo_prints_the_final_state_before_finishing() -> None:
    proc = subprocess.run([sys.executable, "-m", "plugin", "demo", "--duration", "2", "--plain"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.rstrip("\n").splitlines()
    assert lines[-1] == FINISHED
    assert lines[0].endswith("plugin registered: 8 GPUs advertised, all Healthy")
    table_at = max(i for i, ln in enumerate(lines) if "capacity=" in ln)
    assert_final_state(parse_frame("\n".join(lines[table_at:])))

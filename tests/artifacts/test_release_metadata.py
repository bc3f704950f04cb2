"""One version and one license for everything the project ships.

pyproject.toml's ``version`` is the one source: the chart's ``version`` and ``appVersion``, every kustomize image
tag of our image, the Dockerfile's ``VERSION`` build argument (which the OCI version label is made of), and every
image reference or ``?ref=v`` in the Dockerfile, the README and docs/ must say the same. The programs' ``--version``
reads the installed distribution's metadata, which pyproject.toml wrote (tests/unit/test_version.py).

LICENSE holds the Apache License 2.0; pyproject.toml, the image's ``licenses`` label and the chart (where it states a
license) must name that one."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from tests.artifacts.test_dockerfile import stages

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
CHART = REPO / "charts" / "gpu-health-device-plugin" / "Chart.yaml"
DOCKERFILE = REPO / "Dockerfile"
IMAGE = "gpu-health-device-plugin"
SPDX = "Apache-2.0"


def _labels() -> dict[str, str]:
    runtime = stages(DOCKERFILE.read_text())[-1]
    text = " ".join(a for k, a in runtime if k == "LABEL")
    return dict(re.findall(r'([\w.]+)="([^"]*)"', text))


def test_every_kustomize_tag_of_our_image_is_the_package_version() -> None:
    tags = {}
    for k in sorted((REPO / "manifests").rglob("kustomization.yaml")):
        for image in yaml.safe_load(k.read_text()).get("images", []):
            if image["name"] == IMAGE or image.get("newName", "").endswith("/" + IMAGE):
                tags[str(k.relative_to(REPO))] = image.get("newTag")
    assert "manifests/base/kustomization.yaml" in tags
    assert {k: t for k, t in tags.items() if t != VERSION} == {}


def test_the_chart_and_the_image_label_carry_the_package_version() -> None:
    chart = yaml.safe_load(CHART.read_text())
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for k, a in stages(DOCKERFILE.read_text())[-1]
            if k == "ARG" and "=" in a}
    assert args["VERSION"] == VERSION
    assert _labels()["org.opencontainers.image.version"] == "${VERSION}", "the label is the build argument"


def test_every_written_image_reference_is_the_package_version() -> None:
    texts = [DOCKERFILE, REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = []
    for path in texts:
        for m in re.finditer(rf"\b{IMAGE}:(\d+\.\d+\.\d+[\w.+-]*)|\?ref=v(\d+\.\d+\.\d+[\w.+-]*)", path.read_text()):
            found.append((path.name, m.group(1) or m.group(2)))
    assert found, "the pattern finds the image references"
    assert [f for f in found if f[1] != VERSION] == []


def test_the_license_is_apache_2_and_everything_says_so() -> None:
    text = (REPO / "LICENSE").read_text()
    head = [line.strip() for line in text.splitlines() if line.strip()][:2]
    assert head == ["Apache License", "Version 2.0, January 2004"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text, "the whole license, not a pointer to it"
    assert PYPROJECT["project"]["license"] == {"text": SPDX}
    assert _labels()["org.opencontainers.image.licenses"] == SPDX
    chart = yaml.safe_load(CHART.read_text())
    stated = {k: v for k, v in (chart.get("annotations") or {}).items() if "license" in k.lower()}
    assert all(v == SPDX for v in stated.values()), stated


def test_the_image_build_carries_the_license_into_the_wheel() -> None:
    build = stages(DOCKERFILE.read_text())[0]
    copied = {p for k, a in build if k == "COPY" for p in a.split()[:-1]}
    assert "LICENSE" in copied
    allowed = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.startswith("!")]
    assert "!LICENSE" in allowed

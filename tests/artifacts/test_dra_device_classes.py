"""mode: dra's DeviceClasses (docs/dra.md, "Pods that ask for nvidia.com/gpu"), as manifests/components/dra ships
them and as the chart renders them: gpu.gpu-health.io (whole GPUs, serving nvidia.com/gpu), mig.gpu-health.io (any
MIG instance) and mig-<profile>.gpu-health.io per MIG profile (serving nvidia.com/mig-<profile>).

The selectors are checked as exact strings, and through a small reading of the one CEL shape they use (clauses
joined by ``&&``: the driver, then ``attributes[domain].?name.orValue(fallback) == value``) against the devices the
driver publishes, so that every device lands in the classes it should. The API server compiles them for real in
tests/conformance/apiserver/test_manifests_server.py (a server-side dry run of overlays/dra)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugin.dra.slices import DRIVER
from plugin.validation import is_dns_subdomain, is_extended_resource_name
from tests.artifacts.test_chart import CHART, helm, helm_run, helm_template, template_args
from tests.artifacts.test_manifests import MANIFESTS, kubectl, render, strict_problems
from tests.artifacts.test_manifests_dra import (
    DEFAULT_PROFILES,
    GPU_SELECTOR,
    MIG_CLASS,
    MIG_SELECTOR,
    profile_class,
    profile_resource,
    profile_selector,
)

__all__ = ["helm", "kubectl"]

Obj = dict[str, Any]

GPU_CLASS = DRIVER
TYPE = f'device.attributes["{DRIVER}"].?type.orValue("gpu")'


# The one CEL shape the classes use ---------------------------------------------------------------------------------

_DRIVER_CLAUSE = re.compile(r'device\.driver == "(?P<driver>[a-z0-9.-]+)"')
_ATTRIBUTE_CLAUSE = re.compile(
    r'device\.attributes\["(?P<domain>[a-z0-9.-]+)"\]\.\?(?P<name>[A-Za-z]+)\.orValue\("(?P<fallback>[^"]*)"\) == '
    r'"(?P<value>[^"]+)"')


@dataclass(frozen=True)
class Selector:
    """A selector of the shape above: the driver, and per attribute (its fallback when absent, the value wanted)."""

    driver: str
    attributes: tuple[tuple[str, str, str], ...]

    def matches(self, driver: str, attributes: Mapping[str, str]) -> bool:
        # CEL's && is false as soon as one side is, whatever the other: another driver's device matches nothing.
        return driver == self.driver and all(attributes.get(name, fallback) == value
                                             for name, fallback, value in self.attributes)


def parse(expression: str) -> Selector:
    first, *rest = expression.split(" && ")
    m = _DRIVER_CLAUSE.fullmatch(first)
    assert m, f"not a driver clause: {first!r} in {expression!r}"
    attributes = []
    for clause in rest:
        a = _ATTRIBUTE_CLAUSE.fullmatch(clause)
        assert a, f"not an attribute clause read with .?name.orValue(): {clause!r} in {expression!r}"
        # The driver's own attributes only: its domain is the driver's name.
        assert a["domain"] == m["driver"], clause
        attributes.append((a["name"], a["fallback"], a["value"]))
    return Selector(m["driver"], tuple(attributes))


def test_the_selectors_as_written() -> None:
    # Spelt out once, as a reader of the manifests sees them.
    assert GPU_SELECTOR == ('device.driver == "gpu.gpu-health.io" && '
                            'device.attributes["gpu.gpu-health.io"].?type.orValue("gpu") == "gpu"')
    assert MIG_SELECTOR == ('device.driver == "gpu.gpu-health.io" && '
                            'device.attributes["gpu.gpu-health.io"].?type.orValue("gpu") == "mig"')
    assert profile_selector("1g.10gb") == (
        'device.driver == "gpu.gpu-health.io" && device.attributes["gpu.gpu-health.io"].?type.orValue("gpu") == "mig"'
        ' && device.attributes["gpu.gpu-health.io"].?profile.orValue("") == "1g.10gb"')


def test_the_reading_of_a_selector_refuses_what_it_does_not_know() -> None:
    assert parse(profile_selector("1g.10gb+me")) == Selector(DRIVER, (("type", "gpu", "mig"),
                                                                       ("profile", "", "1g.10gb+me")))
    # A bare .type (a CEL error on a device without it) and an || are not the shape.
    for bad in (f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"',
                f'device.driver == "{DRIVER}" || {TYPE} == "gpu"',
                f'device.driver == "{DRIVER}" && device.attributes["other.io"].?type.orValue("gpu") == "gpu"'):
        with pytest.raises(AssertionError):
            parse(bad)


# Renderings --------------------------------------------------------------------------------------------------------

def classes(objs: Iterable[Obj]) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == "DeviceClass"}


def expression(dc: Obj) -> str:
    [selector] = dc["spec"]["selectors"]
    text: str = selector["cel"]["expression"]
    return text


def chart(helm: Path, values: Mapping[str, Any] | None, tmp_path: Path, *sets: str) -> list[Obj]:
    files = []
    if values is not None:
        f = tmp_path / "values.yaml"
        f.write_text(yaml.safe_dump(dict(values)))
        files.append(f)
    return helm_template(helm, files, ("mode=dra", *sets))


@pytest.fixture(scope="module")
def shipped(helm: Path, kubectl: Path) -> dict[str, list[Obj]]:
    """overlays/dra (components/dra on the base) and the chart's default mode: dra rendering."""
    return {"kustomize": render(kubectl, MANIFESTS / "overlays" / "dra"),
            "chart": helm_template(helm, sets=("mode=dra",))}


def expected(profiles: Iterable[str], resource: str | None = "nvidia.com/gpu") -> dict[str, tuple[str, str | None]]:
    """Class name -> (selector, extended resource) for the given profiles and whole-GPU resource."""
    domain = resource.split("/")[0] if resource else None
    out: dict[str, tuple[str, str | None]] = {GPU_CLASS: (GPU_SELECTOR, resource), MIG_CLASS: (MIG_SELECTOR, None)}
    for p in profiles:
        out[profile_class(p)] = (profile_selector(p), profile_resource(p, domain) if domain else None)
    return out


def found(objs: Iterable[Obj]) -> dict[str, tuple[str, str | None]]:
    return {name: (expression(dc), dc["spec"].get("extendedResourceName")) for name, dc in classes(objs).items()}


# The shipped classes -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["kustomize", "chart"])
def test_the_shipped_classes_their_selectors_and_extended_resources(shipped: dict[str, list[Obj]],
                                                                    source: str) -> None:
    assert found(shipped[source]) == expected(DEFAULT_PROFILES)
    for name, dc in classes(shipped[source]).items():
        assert is_dns_subdomain(name), name
        resource = dc["spec"].get("extendedResourceName")
        assert resource is None or is_extended_resource_name(resource), resource
        # Each class is the driver's, whatever the rest of the selector says.
        assert parse(expression(dc)).driver == DRIVER


def test_the_default_profiles_are_common_a100_and_h100_ones_and_1g_10gb_names_validly() -> None:
    assert {"1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb", "1g.5gb", "3g.20gb", "7g.40gb"} <= set(DEFAULT_PROFILES)
    assert len(set(DEFAULT_PROFILES)) == len(DEFAULT_PROFILES)
    assert profile_class("1g.10gb") == "mig-1g.10gb.gpu-health.io"
    assert is_dns_subdomain(profile_class("1g.10gb"))
    assert is_extended_resource_name(profile_resource("1g.10gb"))
    # The `+` of a media-extension profile is in neither name: its class and resource carry a `.`.
    assert "1g.10gb+me" in DEFAULT_PROFILES
    assert not is_dns_subdomain("mig-1g.10gb+me.gpu-health.io")
    assert not is_extended_resource_name("nvidia.com/mig-1g.10gb+me")


# What each class selects: every published device in exactly the classes it belongs to ------------------------------

# (driver, attributes) of the devices a node can publish, and the classes that must select each.
DEVICES: dict[str, tuple[str, dict[str, str], set[str]]] = {
    "a whole GPU": (DRIVER, {"type": "gpu", "uuid": "GPU-1"}, {GPU_CLASS}),
    # A plugin older than the type attribute published whole GPUs only: without the fallback the selector would be a
    # CEL error on them, which aborts the scheduling of every pod of the class.
    "a whole GPU of an older plugin (no type)": (DRIVER, {"uuid": "GPU-2"}, {GPU_CLASS}),
    "a 1g.10gb instance": (DRIVER, {"type": "mig", "profile": "1g.10gb"}, {MIG_CLASS, profile_class("1g.10gb")}),
    "a 1g.10gb+me instance": (DRIVER, {"type": "mig", "profile": "1g.10gb+me"},
                              {MIG_CLASS, profile_class("1g.10gb+me")}),
    "a 7g.80gb instance": (DRIVER, {"type": "mig", "profile": "7g.80gb"}, {MIG_CLASS, profile_class("7g.80gb")}),
    "an instance of a profile with no class": (DRIVER, {"type": "mig", "profile": "1g.24gb"}, {MIG_CLASS}),
    "an instance without a profile": (DRIVER, {"type": "mig"}, {MIG_CLASS}),
    "another driver's GPU": ("gpu.nvidia.com", {"type": "gpu"}, set()),
}


@pytest.mark.parametrize("device", DEVICES)
def test_each_device_is_selected_by_exactly_its_classes(shipped: dict[str, list[Obj]], device: str) -> None:
    driver, attributes, want = DEVICES[device]
    for source, objs in shipped.items():
        got = {name for name, dc in classes(objs).items() if parse(expression(dc)).matches(driver, attributes)}
        assert got == want, f"{source}: {device}"


# The chart's values ------------------------------------------------------------------------------------------------

def test_an_empty_extended_resource_name_leaves_every_class_without_one(helm: Path, tmp_path: Path) -> None:
    objs = chart(helm, {"dra": {"extendedResourceName": ""}}, tmp_path)
    assert found(objs) == expected(DEFAULT_PROFILES, resource=None)
    assert not any("extendedResourceName" in dc["spec"] for dc in classes(objs).values())


def test_another_extended_resource_name_moves_the_mig_resources_to_its_domain(helm: Path, tmp_path: Path) -> None:
    objs = chart(helm, {"dra": {"extendedResourceName": "example.com/gpu", "migProfiles": ["1g.10gb"]}}, tmp_path)
    assert found(objs) == expected(["1g.10gb"], resource="example.com/gpu")
    assert classes(objs)[profile_class("1g.10gb")]["spec"]["extendedResourceName"] == "example.com/mig-1g.10gb"


def test_a_profile_list_makes_one_valid_class_per_profile(helm: Path, tmp_path: Path) -> None:
    profiles = ["1g.12gb", "3g.47gb", "1g.24gb+gfx", "1g.23gb-me", "1g.23gb+me.all", "7g.141gb"]
    objs = chart(helm, {"dra": {"migProfiles": profiles}}, tmp_path)
    assert found(objs) == expected(profiles)
    assert sorted(classes(objs)) == sorted([GPU_CLASS, MIG_CLASS, "mig-1g.12gb.gpu-health.io",
                                            "mig-3g.47gb.gpu-health.io", "mig-1g.24gb.gfx.gpu-health.io",
                                            "mig-1g.23gb-me.gpu-health.io", "mig-1g.23gb.me.all.gpu-health.io",
                                            "mig-7g.141gb.gpu-health.io"])
    # The `+` is only in the names' spelling: the selector matches the profile the driver publishes.
    dc = classes(objs)["mig-1g.24gb.gfx.gpu-health.io"]
    assert parse(expression(dc)).matches(DRIVER, {"type": "mig", "profile": "1g.24gb+gfx"})
    assert not parse(expression(dc)).matches(DRIVER, {"type": "mig", "profile": "1g.24gb.gfx"})
    assert dc["spec"]["extendedResourceName"] == "nvidia.com/mig-1g.24gb.gfx"
    problems, _ = strict_problems((("profiles", o) for o in classes(objs).values()), "1.37.0")
    assert not problems, problems


def test_no_profiles_leave_the_whole_gpu_and_any_mig_classes(helm: Path, tmp_path: Path) -> None:
    assert found(chart(helm, {"dra": {"migProfiles": []}}, tmp_path)) == expected([])


def test_device_plugin_mode_renders_no_device_class(helm: Path) -> None:
    assert classes(helm_template(helm)) == {}


def _rendering_error(helm: Path, values: Mapping[str, Any], tmp_path: Path, *extra: str) -> str:
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(dict(values)))
    out = helm_run(helm, *template_args([f], ("mode=dra",)), *extra)
    assert out.returncode != 0, f"rendered with {values}"
    return out.stderr


@pytest.mark.parametrize("profile", ["1g.10gb_x", "1G.10GB", "1g..10gb", "1g.10gb+", "+me", "1g 10gb",
                                     "1g/10gb", "1" * 60])
def test_a_profile_that_cannot_make_a_name_is_refused_naming_it(helm: Path, tmp_path: Path, profile: str) -> None:
    values = {"dra": {"migProfiles": ["1g.10gb", profile]}}
    # The schema stops it, naming the entry...
    err = _rendering_error(helm, values, tmp_path)
    assert "/dra/migProfiles/1" in err, err
    # ...and past the schema the chart's own check does, naming the profile.
    err = _rendering_error(helm, values, tmp_path, "--skip-schema-validation")
    assert f'dra.migProfiles: "{profile}" makes no valid DeviceClass name' in err, err


def test_two_profiles_that_make_one_name_are_refused(helm: Path, tmp_path: Path) -> None:
    err = _rendering_error(helm, {"dra": {"migProfiles": ["1g.10gb+me", "1g.10gb.me"]}}, tmp_path)
    assert ('dra.migProfiles: "1g.10gb+me" and "1g.10gb.me" both make the DeviceClass mig-1g.10gb.me.gpu-health.io '
            "('+' becomes '.')") in err, err


@pytest.mark.parametrize("name", ["gpu", "nvidia.com/", "kubernetes.io/gpu", "example.kubernetes.io/gpu",
                                  "requests.nvidia.com/gpu", "Nvidia.com/gpu", "nvidia.com/" + "g" * 64])
def test_an_extended_resource_name_pods_cannot_ask_for_is_refused(helm: Path, tmp_path: Path, name: str) -> None:
    assert not is_extended_resource_name(name)
    err = _rendering_error(helm, {"dra": {"extendedResourceName": name}}, tmp_path)
    assert "/dra/extendedResourceName" in err, err


def test_a_valid_extended_resource_name_passes_the_schema(helm: Path, tmp_path: Path) -> None:
    name = "example.com/" + "g" * 63
    assert is_extended_resource_name(name)
    objs = chart(helm, {"dra": {"extendedResourceName": name, "migProfiles": []}}, tmp_path)
    assert classes(objs)[GPU_CLASS]["spec"]["extendedResourceName"] == name


def test_docs_dra_names_both_values() -> None:
    # A reader of the page finds the switch and the list.
    text = (CHART.parents[1] / "docs" / "dra.md").read_text()
    assert "dra.extendedResourceName" in text
    assert "dra.migProfiles" in text

"""A MIG profile with a `+` (the media-extension profiles, `1g.10gb+me`) is no valid extended resource name: the kubelet
refuses a device plugin's registration of `nvidia.com/mig-1g.10gb+me`, so the whole resource would never appear.
Both modes name its resource `nvidia.com/mig-1g.10gb.me` (as NVIDIA's plugin does, and the DRA DeviceClasses), and a
sharing entry names it so."""

from __future__ import annotations

import pytest

from plugin.dra.shares import resource_of
from plugin.kubelet.sharing import build_resources
from plugin.sharing.config import parse_sharing, validate
from plugin.sharing.model import base_pools, mig_pool, mig_resource
from plugin.validation import is_extended_resource_name


@pytest.mark.parametrize(("profile", "name"), [("1g.10gb", "nvidia.com/mig-1g.10gb"),
                                               ("1g.10gb+me", "nvidia.com/mig-1g.10gb.me"),
                                               ("1g.20gb+gfx", "nvidia.com/mig-1g.20gb.gfx")])
def test_every_profile_gets_a_valid_resource_name_in_both_modes(profile: str, name: str) -> None:
    assert mig_resource("nvidia.com/gpu", profile) == name and is_extended_resource_name(name)
    assert (name, mig_pool(profile)) in base_pools("nvidia.com/gpu", "mixed", [profile])
    assert resource_of("nvidia.com/gpu", profile) == name


def test_the_device_plugin_serves_the_media_profile_under_the_valid_name_and_it_can_be_shared() -> None:
    sharing = parse_sharing({"timeSlicing": {"resources": [{"name": "nvidia.com/mig-1g.10gb.me", "replicas": 2}]}})
    validate(sharing, "nvidia.com/gpu", "mixed")
    names = [r.name for r in build_resources("nvidia.com/gpu", "mixed", sharing, ["1g.10gb", "1g.10gb+me"])]
    assert names == ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-1g.10gb.me"]
    assert all(is_extended_resource_name(n) for n in names)

"""The validation leaf: Kubernetes' own name rules, shared by every config section and outlet, and the one error
type for a bad value at a path."""

from __future__ import annotations

import pytest

from plugin import validation
from plugin.config import ConfigError, load
from plugin.sharing.config import SharingError, parse_sharing
from plugin.validation import (
    FieldError,
    check_condition_type,
    check_node_name,
    is_dns_subdomain,
    is_extended_resource_name,
    is_qualified_name,
    is_reason_code,
)


def test_field_error_names_the_field_and_is_every_sections_error() -> None:
    e = FieldError("health.xid.fatal", "expected a list of XID numbers")
    assert (str(e), e.field, e.message) == ("health.xid.fatal: expected a list of XID numbers", "health.xid.fatal",
                                            "expected a list of XID numbers")
    assert isinstance(e, ValueError) and ConfigError is FieldError and SharingError is FieldError


@pytest.mark.parametrize("name", ["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb",
                                  "example.com/A_b", "k8s.io/gpu", "a/" + "x" * 63, "x" * 244 + "/gpu"])
def test_extended_resource_names_the_kubelet_accepts(name: str) -> None:
    assert is_extended_resource_name(name)


@pytest.mark.parametrize("name", [
    "gpu", "/gpu", "nvidia.com/", "nvidia.com/a/b", "Nvidia.com/gpu", "nvidia.com/-gpu", "nvidia.com/gpu-",
    "kubernetes.io/gpu", "gpu.kubernetes.io/x", "mykubernetes.io/x",  # the native namespace, as the kubelet sees it
    "requests.example.com/gpu",  # quota's prefix
    "a..b/gpu", "a.-b/gpu", "-a.io/gpu",  # domains that are not DNS subdomains
    "a/" + "x" * 64,  # the name part is at most 63 characters
    "x" * 245 + "/gpu",  # requests.<domain> must stay within 253 characters
    "nvidia.com/gpu\n",
])
def test_extended_resource_names_the_kubelet_refuses(name: str) -> None:
    assert not is_extended_resource_name(name)


def test_every_resource_name_setting_uses_the_kubelets_rule() -> None:
    with pytest.raises(ConfigError, match=r"--resource-name: expected an extended resource name"):
        load({"resource_name": "gpu.kubernetes.io/gpu"}, {}, None)
    with pytest.raises(SharingError, match=r"resources\[0\]\.rename: expected an extended resource name"):
        parse_sharing({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2,
                                                      "rename": "requests.nvidia.com/gpu"}]}})


def test_dns_subdomains_and_qualified_names() -> None:
    assert is_dns_subdomain("gpu-health.io") and is_dns_subdomain("a" * 253)
    assert not any(is_dns_subdomain(s) for s in ("", "a" * 254, "A.io", "a..b", "a-.b", "a_b"))
    assert is_qualified_name("GPUHealthy") and is_qualified_name("example.com/GPU_healthy.2")
    assert not any(is_qualified_name(s) for s in ("", "/x", "a..b/X", "a/b/c", "x" * 64, "has space"))


def test_condition_types_take_a_dns_subdomain_prefix() -> None:
    assert check_condition_type("example.com/GPUHealthy") == "example.com/GPUHealthy"
    for bad in ("a..b/GPUHealthy", "-a/GPUHealthy", "a" * 253 + "/" + "b" * 63):
        with pytest.raises(ValueError, match="qualified name"):
            check_condition_type(bad)


def test_node_names_are_dns_subdomains_or_empty() -> None:
    assert check_node_name("") == "" and check_node_name("gpu-node-7.zone") == "gpu-node-7.zone"
    with pytest.raises(ValueError, match="node name"):
        check_node_name("a" * 254)


def test_reason_codes() -> None:
    assert is_reason_code("xid-79") and is_reason_code("ecc-corrected-rate")
    assert not any(is_reason_code(s) for s in ("", "Xid-79", "xid--79", "-xid", "xid-", "xid_79", "xid-79\n"))


@pytest.mark.parametrize(("text", "label", "value"), [
    ("gpu-0", True, True),
    ("", False, True),
    ("a" * 63, True, True),
    ("a" * 64, False, False),
    ("GPU-0", False, True),
    ("xid-79.repeated_x", False, True),
    ("-edge", False, False),
    ("edge.", False, False),
    ("has space", False, False),
])
def test_dns_labels_and_label_values(text: str, label: bool, value: bool) -> None:
    assert validation.is_dns_label(text) is label
    assert validation.is_label_value(text) is value

"""DRA mode's grants as shipped (the base ClusterRole's rules and components/dra/rbac.yaml's), bound to a service
account of the plugin's name in a namespace of the test's own: what the admission-policy tests narrow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MANIFESTS = Path(__file__).resolve().parents[3] / "manifests"


def dra_grants(prefix: str, service_account: str, namespace: str) -> list[dict[str, Any]]:
    """Two ClusterRoles (``<prefix>-plugin``, ``<prefix>-plugin-dra``) and their bindings to the account."""
    base_rules = yaml.safe_load((MANIFESTS / "base" / "clusterrole.yaml").read_text())["rules"]
    dra_role = next(d for d in yaml.safe_load_all((MANIFESTS / "components" / "dra" / "rbac.yaml").read_text())
                    if d["kind"] == "ClusterRole")
    objs: list[dict[str, Any]] = []
    for role, rules in ((f"{prefix}-plugin", base_rules), (f"{prefix}-plugin-dra", dra_role["rules"])):
        objs += [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": role},
             "rules": rules},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": role},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
             "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}]},
        ]
    return objs

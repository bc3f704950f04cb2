"""The Kubernetes API as the cluster outlets use it: the calls they make, the views they read back, and the one
error type every failure becomes (:class:`ApiFailure`, with the HTTP status and ``Retry-After`` when there is one).

The outlets depend on the two small protocols (:class:`KubeApi` for the node reporter, :class:`PodApi` for pod
correlation); tests hand them fakes. :class:`LightkubeApi` implements both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

FIELD_MANAGER = "gpu-health-device-plugin"


class ApiFailure(Exception):
    def __init__(self, status: int | None, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


@dataclass(frozen=True)
class NodeView:
    """What we know of the Node on the server: enough to compute patches and address Events."""

    name: str
    uid: str
    resource_version: str
    annotations: dict[str, str]
    conditions: list[dict[str, Any]] = field(default_factory=list)


class KubeApi(Protocol):
    def get_node(self, name: str) -> NodeView: ...
    def patch_node_annotations(self, name: str, patch: Mapping[str, str | None],
                               resource_version: str | None) -> NodeView: ...
    def patch_node_condition(self, name: str, condition: Mapping[str, str]) -> NodeView: ...
    def create_event(self, namespace: str, body: Mapping[str, Any]) -> str: ...
    def patch_event(self, namespace: str, name: str, body: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class PodView:
    uid: str
    node_name: str


class PodApi(Protocol):
    def get_pod(self, namespace: str, name: str) -> PodView: ...
    def create_event(self, namespace: str, body: Mapping[str, Any]) -> str: ...
    def patch_pod_annotations(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None: ...
    def evict_pod(self, namespace: str, name: str, uid: str) -> None: ...
    def close(self) -> None: ...


class LightkubeApi:
    """:class:`KubeApi` over lightkube: in-cluster service-account config, or a kubeconfig file outside."""

    def __init__(self, kubeconfig: Path | None = None, timeout_s: float = 10.0) -> None:
        import httpx2
        from lightkube import Client, KubeConfig
        from lightkube.core.exceptions import ConfigError

        try:
            config = KubeConfig.from_file(kubeconfig) if kubeconfig else KubeConfig.from_service_account()
            self._client = Client(config=config, timeout=httpx2.Timeout(timeout_s), field_manager=FIELD_MANAGER)
        except (ConfigError, OSError, KeyError, ValueError) as exc:
            where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account (or --kubeconfig)"
            raise ApiFailure(None, f"cannot configure a Kubernetes client from {where}: {exc!r}") from None

    @staticmethod
    def _view(node: Any) -> NodeView:
        meta = node.metadata
        conditions = [c.to_dict() for c in (node.status.conditions or [])] if node.status else []
        return NodeView(name=meta.name, uid=meta.uid or "", resource_version=meta.resourceVersion or "",
                        annotations=dict(meta.annotations or {}), conditions=conditions)

    def _call(self, fn: Callable[[], Any]) -> Any:
        from lightkube.core.exceptions import ApiError
        try:
            return fn()
        except ApiError as exc:
            retry = exc.response.headers.get("Retry-After") if exc.response is not None else None
            code: int | None = exc.status.code or (exc.response.status_code if exc.response is not None else None)
            raise ApiFailure(code, exc.status.message or str(exc), _seconds(retry)) from None
        except Exception as exc:  # the transport's many errors, a non-JSON error body: all are "API trouble"
            response = getattr(exc, "response", None)
            status = getattr(response, "status_code", None)
            http = status if isinstance(status, int) else None
            retry = response.headers.get("Retry-After") if response is not None else None
            raise ApiFailure(http, f"{type(exc).__name__}: {exc}", _seconds(retry)) from None

    def get_node(self, name: str) -> NodeView:
        from lightkube.resources.core_v1 import Node
        return self._view(self._call(lambda: self._client.get(Node, name)))

    def patch_node_annotations(self, name: str, patch: Mapping[str, str | None],
                               resource_version: str | None) -> NodeView:
        from lightkube.resources.core_v1 import Node
        from lightkube.types import PatchType
        meta: dict[str, Any] = {"annotations": dict(patch)}
        if resource_version:
            meta["resourceVersion"] = resource_version  # a precondition: 409 if the node moved on
        return self._view(self._call(lambda: self._client.patch(Node, name, {"metadata": meta},
                                                                patch_type=PatchType.MERGE)))

    def patch_node_condition(self, name: str, condition: Mapping[str, str]) -> NodeView:
        from lightkube.resources.core_v1 import Node
        from lightkube.types import PatchType
        # Strategic merge on conditions (merge key: type) touches our condition only.
        body = {"status": {"conditions": [dict(condition)]}}
        return self._view(self._call(lambda: self._client.patch(Node.Status, name, body,
                                                                patch_type=PatchType.STRATEGIC)))

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> str:
        from lightkube.resources.core_v1 import Event
        event = Event.from_dict(dict(body))
        created = self._call(lambda: self._client.create(event, namespace=namespace))  # type: ignore[call-overload]
        return str(created.metadata.name)

    def patch_event(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        from lightkube.resources.core_v1 import Event
        from lightkube.types import PatchType
        self._call(lambda: self._client.patch(Event, name, dict(body), namespace=namespace,
                                              patch_type=PatchType.MERGE))

    def get_pod(self, namespace: str, name: str) -> PodView:
        from lightkube.resources.core_v1 import Pod
        pod = self._call(lambda: self._client.get(Pod, name, namespace=namespace))
        return PodView(uid=pod.metadata.uid or "", node_name=(pod.spec.nodeName or "") if pod.spec else "")

    def patch_pod_annotations(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None:
        from lightkube.resources.core_v1 import Pod
        from lightkube.types import PatchType
        body = {"metadata": {"annotations": dict(annotations)}}
        self._call(lambda: self._client.patch(Pod, name, body, namespace=namespace, patch_type=PatchType.MERGE))

    def evict_pod(self, namespace: str, name: str, uid: str) -> None:
        from lightkube.models.meta_v1 import DeleteOptions, ObjectMeta, Preconditions
        from lightkube.resources.core_v1 import Pod
        # The UID precondition: never evict a new pod that took the old one's name after our lookup.
        opts = DeleteOptions(preconditions=Preconditions(uid=uid)) if uid else None
        body = Pod.Eviction(metadata=ObjectMeta(name=name, namespace=namespace), deleteOptions=opts)
        self._call(lambda: self._client.create(body, name=name, namespace=namespace))

    def close(self) -> None:
        self._client.close()


def _seconds(v: str | None) -> float | None:
    try:
        return max(0.0, float(v)) if v else None
    except ValueError:
        return None  # an HTTP date: rare from the API server, and the back-off still applies

"""An oracle for the resources' cached ListAndWatch encoding: the same message built field by field."""

from __future__ import annotations

from api.deviceplugin.v1beta1 import api_pb2
from plugin.kubelet.resources import KubeletDevice


def field_by_field(view: tuple[KubeletDevice, ...]) -> api_pb2.ListAndWatchResponse:
    resp = api_pb2.ListAndWatchResponse()
    for d in view:
        dev = resp.devices.add(ID=d.id, health=d.health)
        if d.numa_node is not None:
            dev.topology.nodes.add(ID=d.numa_node)
    return resp

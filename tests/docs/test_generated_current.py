import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_protobuf_code_is_current() -> None:
    """The committed *_pb2 files and stubs must be exactly what scripts/gen_protos.py produces from api/*.proto."""
    bin_dir = str(Path(sys.executable).parent)
    env = {"PATH": bin_dir + ":/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"], capture_output=True,
                       text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_wire_contract_field_numbers() -> None:
    from api.deviceplugin.v1beta1 import api_pb2

    def num(msg: type, field: str) -> int:
        return int(msg.DESCRIPTOR.fields_by_name[field].number)  # type: ignore[attr-defined]

    assert api_pb2.DESCRIPTOR.package == "v1beta1"
    assert num(api_pb2.RegisterRequest, "options") == 4
    assert num(api_pb2.Device, "topology") == 3
    assert num(api_pb2.ContainerPreferredAllocationRequest, "allocation_size") == 3
    assert num(api_pb2.ContainerAllocateResponse, "cdi_devices") == 5
    assert num(api_pb2.ContainerAllocateResponse, "annotations") == 4
    assert num(api_pb2.DevicePluginOptions, "get_preferred_allocation_available") == 2
    svc = api_pb2.DESCRIPTOR.services_by_name["DevicePlugin"]
    assert [m.name for m in svc.methods] == ["GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation",
                                             "Allocate", "PreStartContainer"]
    assert svc.full_name == "v1beta1.DevicePlugin"

"""GPUs busy with no pod, in the whole plugin: the simulated node lists compute processes, a PodResources server
(the kubelet's API, served by tests/fakes/podresources.py) says which GPU a pod holds."""

from __future__ import annotations

from pathlib import Path

from plugin.health.reasons import State
from tests.fakes.podresources import PodResourcesServer
from tests.integration.conftest import running_app


def test_a_gpu_running_processes_no_pod_holds_turns_degraded_and_back(short_socket_dir: Path,
                                                                      dev_root: Path) -> None:
    pods = PodResourcesServer(short_socket_dir / "pr.sock")
    pods.start()
    try:
        with running_app(short_socket_dir, dev_root, pod_resources_socket=pods.socket_path, busy_grace=0.3,
                         correlate_on=()) as e:
            uuids = e.node.uuids
            pods.assign("ml", "train-0", "main", "nvidia.com/gpu", uuids[3])
            e.node.set(2, compute_processes=[{"pid": 4242, "used_mib": 30000, "name": "python3"}])
            e.node.set(3, compute_processes=[{"pid": 5151, "used_mib": 1000, "name": "python3"}])
            def state(i: int) -> State | None:
                d = e.app.state.snapshot().get(uuids[i])
                return d.state if d is not None else None

            assert e.wait_state(lambda: state(2) == State.DEGRADED)
            d = e.app.state.snapshot().get(uuids[2])
            assert d is not None and [r.code for r in d.reasons] == ["busy-unallocated"]
            assert d.reasons[0].message.startswith("1 process (python3) using 30000 MiB on a GPU no pod holds, for ")
            assert pods.calls >= 2  # asked about GPUs 2 and 3 once their grace was over
            assert state(3) == State.HEALTHY
            e.node.set(2, compute_processes=None)  # the leaked process is killed
            assert e.wait_state(lambda: state(2) == State.HEALTHY)
    finally:
        pods.stop()

"""NVRx compatibility: serve `nvhcd.HealthCheckService/RunHealthCheck` on a Unix socket.

Jobs launched with NVIDIA's resiliency launcher ask this service whether the node is fit to run
on. The answer comes from the controller's verdict on this node (pushed down the session), so
NVRx and Phalanx never disagree about a node. Healthy and DEGRADED nodes pass; FAILING and FAILED
ones do not. Without a verdict yet (agent just started, controller unreachable) the node passes,
as NVRx itself treats an unreachable checker.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import grpc

from agent import unix_socket
from phalanx import log
from phalanx.nvhcd import nvhcd_pb2, nvhcd_pb2_grpc
from phalanx.v1 import common_pb2

logger = log.get("nvrx")


def answer(verdict: common_pb2.NodeHealth | None, connected: bool) -> nvhcd_pb2.HealthCheckResponse:
    """The NVRx answer for a verdict: success unless FAILING or FAILED; JSON details in `output`."""
    if verdict is None or verdict.health == common_pb2.HEALTH_UNSPECIFIED:
        # the controller pushes every verdict but a session's first HEALTHY (agent.link): connected and told
        # nothing is healthy; not connected, nobody knows
        body = {"fail_count": 0, "health": "HEALTHY" if connected else "UNKNOWN", "reasons": [],
                "controller_connected": connected}
        return nvhcd_pb2.HealthCheckResponse(success=True, exit_code=0, output=json.dumps(body))
    failing = [g for g in verdict.gpus if g.health >= common_pb2.HEALTH_FAILING]
    ok = verdict.health < common_pb2.HEALTH_FAILING
    body = {
        "fail_count": 0 if ok else max(1, len(failing)),
        "health": common_pb2.Health.Name(verdict.health).removeprefix("HEALTH_"),
        "reasons": list(verdict.reasons),
        "failing_gpus": [g.index for g in failing],
        "controller_connected": connected,
    }
    return nvhcd_pb2.HealthCheckResponse(success=ok, exit_code=0 if ok else 1, output=json.dumps(body),
                                         error="" if ok else "; ".join(verdict.reasons[:3]))


class NvrxHealthService(nvhcd_pb2_grpc.HealthCheckServiceServicer):
    def __init__(self, verdict: Callable[[], common_pb2.NodeHealth | None], connected: Callable[[], bool]) -> None:
        self._verdict = verdict
        self._connected = connected

    async def RunHealthCheck(self, request: nvhcd_pb2.HealthCheckRequest, context) -> nvhcd_pb2.HealthCheckResponse:
        return answer(self._verdict(), self._connected())


async def serve(path: str, service: NvrxHealthService, group: str = "") -> grpc.aio.Server:
    """Listen on the Unix socket `path` (mode 0660). Raises OSError if it cannot."""
    server = await unix_socket.serve(path, lambda s: nvhcd_pb2_grpc.add_HealthCheckServiceServicer_to_server(
        service, s), group)
    logger.info("NVRx node health check serving", socket=path)
    return server

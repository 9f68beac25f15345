"""EnrolService: nodes enrolling themselves with a bootstrap token (controller/credentials.py)."""

from __future__ import annotations

from controller.api.rpc import unary
from controller.credentials import Credentials
from controller.errors import InvalidArgument
from phalanx.v1 import enrol_pb2, enrol_pb2_grpc

MAX_CSR_BYTES = 16 * 1024  # a P-256 or RSA-4096 request is a few KiB


class EnrolService(enrol_pb2_grpc.EnrolServiceServicer):
    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials

    @unary
    async def GetClusterCa(self, request: enrol_pb2.GetClusterCaRequest, context):
        return enrol_pb2.GetClusterCaResponse(ca_pem=self._credentials.ca_pem())

    @unary
    async def Enrol(self, request: enrol_pb2.EnrolRequest, context):
        if not request.token:
            raise InvalidArgument("token is empty: give the bootstrap token (`phalanx certs token create`)")
        if not request.csr_pem or len(request.csr_pem) > MAX_CSR_BYTES:
            raise InvalidArgument(f"csr_pem must be a certificate signing request of at most {MAX_CSR_BYTES} bytes")
        cert, ca, not_after_ns = await self._credentials.enrol(request.token, request.csr_pem, context.peer())
        return enrol_pb2.EnrolResponse(cert_pem=cert, ca_pem=ca, not_after_unix_ns=not_after_ns)

"""Errors a client sees: one JSON shape on every endpoint, and how backend gRPC codes map to it."""
from __future__ import annotations

from dataclasses import dataclass

import grpc
from pydantic import BaseModel

INVALID = "invalid_request_error"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: None = None
    code: int  # the HTTP status


class ErrorBody(BaseModel):
    """The OpenAI error shape, which the `openai` client parses into e.g. BadRequestError."""
    error: ErrorDetail


@dataclass
class ApiError(Exception):
    status: int  # HTTP status
    message: str
    type: str  # OpenAI-style error type; also the `status` label of the requests counter
    grpc_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN  # what RouterService clients get

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.type, code=self.status)).model_dump()


def invalid(message: str) -> ApiError:
    return ApiError(400, message, INVALID, grpc.StatusCode.INVALID_ARGUMENT)


def internal() -> ApiError:
    """A bug in the router; the traceback goes to its log, never to the client."""
    return ApiError(500, "internal error in the router (see its log)", "server_error", grpc.StatusCode.INTERNAL)


# Backend status -> (HTTP status, error type), per the service contract.
_FROM_GRPC: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, INVALID),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "resource_exhausted"),  # no free KV pages: retry later
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),  # bootstrap or transfer took too long
    grpc.StatusCode.UNAVAILABLE: (502, "backend_unavailable"),  # the peer is dead or unreachable
    grpc.StatusCode.ABORTED: (500, "aborted"),  # a service aborted the room; the client is still here
}


def from_grpc(err: grpc.aio.AioRpcError, backend: str) -> ApiError:
    """`backend` names who failed ("decode 10.0.0.2:7001"), so the message is actionable."""
    status, type_ = _FROM_GRPC.get(err.code(), (502, "backend_error"))
    return ApiError(status, f"{backend}: {err.details() or err.code().name}", type_, err.code())

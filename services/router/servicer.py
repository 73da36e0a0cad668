"""gRPC servicer for kvmesh.router.v1: protobuf in and out of the Router, nothing else.

Errors are raised as kvmesh.errors exceptions; the shared interceptor turns them into status
codes. A cancelled or expired call closes the Router's stream, which cancels the engine call.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.services.router.router import Router


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """Thin adapter from kvmesh.router.v1 to the Router."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request: router_pb2.RouteRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[router_pb2.RouteResponse]:
        async with contextlib.aclosing(self.router.generate(request)) as responses:
            async for response in responses:
                yield response

    async def ListModels(self, request: router_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(models=await self.router.list_models())

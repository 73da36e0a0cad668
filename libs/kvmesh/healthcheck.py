"""`python -m kvmesh.healthcheck HOST:PORT`: exit 0 when the gRPC server there is SERVING.

The container healthcheck of the compose stack (compose/docker-compose.yml): every kvmesh service
serves `grpc.health.v1`, and the image has no separate probe binary. Exit status: 0 SERVING;
1 anything else (NOT_SERVING while draining, UNKNOWN, unreachable, deadline passed), with the
reason on stderr; 2 bad usage.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, *, service: str = "", timeout_s: float = 3.0) -> str:
    """The health status of `service` ('' = the whole server) at `address`: 'SERVING',
    'NOT_SERVING', 'SERVICE_UNKNOWN', ..., or 'UNREACHABLE: <gRPC code>'."""
    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:  # the server does not know `service`
                return "SERVICE_UNKNOWN"
            return f"UNREACHABLE: {err.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvmesh.healthcheck",
        description="Exit 0 when the gRPC server at ADDRESS reports SERVING (grpc.health.v1).")
    parser.add_argument("address", help="host:port of the gRPC server, e.g. 127.0.0.1:50061")
    parser.add_argument("--service", default="",
                        help="health service name, e.g. kvmesh.engine.v1.EngineService "
                             "(default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    if ":" not in args.address:
        parser.error(f"address {args.address!r} needs a port, e.g. 127.0.0.1:50061")
    status = check(args.address, service=args.service, timeout_s=args.timeout)
    if status == "SERVING":
        return 0
    print(f"healthcheck {args.address}: {status}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

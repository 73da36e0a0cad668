"""`python -m kvmesh.healthcheck`: the compose stack's container probe, against a real gRPC
health server on port 0."""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh import healthcheck
from kvmesh.launcher import free_port


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None)


def test_serving_exits_0(health_server):
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.check(address) == "SERVING"
    assert healthcheck.main([address]) == 0


def test_not_serving_exits_1_and_says_why(health_server, capsys):
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # e.g. draining on SIGTERM
    assert healthcheck.main([address]) == 1
    assert f"healthcheck {address}: NOT_SERVING" in capsys.readouterr().err


def test_named_service(health_server):
    address, servicer = health_server
    servicer.set("kvmesh.engine.v1.EngineService", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([address, "--service", "kvmesh.engine.v1.EngineService"]) == 0
    assert healthcheck.check(address, service="kvmesh.router.v1.RouterService") == "SERVICE_UNKNOWN"


def test_unreachable_exits_1(capsys):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert healthcheck.main([address, "--timeout", "1"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().err


def test_address_without_port_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        healthcheck.main(["engine"])
    assert exc.value.code == 2

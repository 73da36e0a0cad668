"""`python -m kvmesh.services.engine`: the engine service process (wiring only)."""
from __future__ import annotations

import os
import sys

from kvmesh.allocator import keep_freed_memory
from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from kvmesh.rpc.entry import Service, serve_main
from kvmesh.services.engine.build import build_async_engine
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.metrics import EngineMetrics
from kvmesh.services.engine.servicer import EngineServicer, model_info
from kvmesh.telemetry import Telemetry
from kvmesh.threads import parse_cpu_list

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


async def build(cfg: EngineConfig, telemetry: Telemetry) -> Service:
    keep_freed_memory()
    if cfg.cpus:  # before any thread starts: torch's pool then counts these cores
        os.sched_setaffinity(0, parse_cpu_list(cfg.cpus))
    engine = build_async_engine(cfg)
    metrics = EngineMetrics(telemetry.registry)
    metrics.instrument(engine)
    if engine.core.kv is not None:
        await engine.core.kv.warm_up()
    servicer = EngineServicer(engine, model_info(engine.core, cfg), on_handoff=metrics.record_handoff)

    async def close() -> None:
        engine.shutdown()
        if engine.core.drafts is not None:
            engine.core.drafts.close()
        if engine.core.kv is not None:
            await engine.core.kv.close()

    return Service(lambda s: engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, s),
                   (SERVICE,), on_drain=lambda: engine.drain(cfg.server.grace_s), close=close)


def main(argv: list[str] | None = None) -> None:
    serve_main(EngineConfig, "engine", build, argv)


if __name__ == "__main__":
    main(sys.argv[1:])

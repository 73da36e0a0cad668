"""`python -m kvmesh.services.draft`: the draft service process (wiring only)."""
from __future__ import annotations

import asyncio
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

from kvmesh.config import describe, load_config
from kvmesh.draft.v1 import draft_pb2, draft_pb2_grpc
from kvmesh.rpc.server import RpcServer, ServerOptions, run_service
from kvmesh.services.draft.build import build_service, load_draft_model
from kvmesh.services.draft.config import DraftConfig
from kvmesh.services.draft.servicer import DraftServicer
from kvmesh.telemetry import setup_telemetry

log = logging.getLogger("kvmesh.draft")
SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


async def serve(cfg: DraftConfig) -> None:
    setup_telemetry("kvmesh-draft", otlp_endpoint=cfg.otlp_endpoint)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-worker")
    loop = asyncio.get_running_loop()
    loaded = await loop.run_in_executor(worker, load_draft_model, cfg)  # on the drafting thread
    servicer = DraftServicer(await loop.run_in_executor(worker, build_service, cfg, loaded), worker)
    log.info("drafters: %s; target model %s", ", ".join(k.value for k in servicer.service.offered),
             servicer.service.target_model)
    server = RpcServer(
        "draft",
        ServerOptions(host=cfg.host, port=cfg.port, grace_s=cfg.grace_s,
                      metrics_port=None if cfg.metrics_port < 0 else cfg.metrics_port),
        lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s),
        [SERVICE])
    sweeper = (asyncio.ensure_future(servicer.sweep_forever(cfg.sweep_interval_s))
               if cfg.sweep_interval_s else None)
    try:
        await run_service(server)
    finally:
        if sweeper is not None:
            sweeper.cancel()
        worker.shutdown(wait=True)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(DraftConfig, "draft", argv)
    log.info("config: %s", describe(cfg))
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main(sys.argv[1:])

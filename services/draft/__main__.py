"""`python -m kvmesh.services.draft`: the draft service process (wiring only)."""
from __future__ import annotations

import asyncio
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

from kvmesh.draft.v1 import draft_pb2, draft_pb2_grpc
from kvmesh.rpc.entry import Service, serve_main
from kvmesh.services.draft.build import build_service, load_draft_model
from kvmesh.services.draft.config import DraftConfig
from kvmesh.services.draft.metrics import DraftMetrics
from kvmesh.services.draft.servicer import DraftServicer
from kvmesh.telemetry import Telemetry

log = logging.getLogger("kvmesh.draft")
SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


async def build(cfg: DraftConfig, telemetry: Telemetry) -> Service:
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-worker")
    loop = asyncio.get_running_loop()
    loaded = await loop.run_in_executor(worker, load_draft_model, cfg)  # on the drafting thread
    service = await loop.run_in_executor(
        worker, lambda: build_service(cfg, loaded, metrics=DraftMetrics(telemetry.registry)))
    servicer = DraftServicer(service, worker)
    log.info("drafters: %s; target model %s", ", ".join(k.value for k in service.offered),
             service.target_model)
    sweeper = (asyncio.ensure_future(servicer.sweep_forever(cfg.sweep_interval_s))
               if cfg.sweep_interval_s else None)

    async def close() -> None:
        if sweeper is not None:
            sweeper.cancel()
        worker.shutdown(wait=True)

    return Service(lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s),
                   (SERVICE,), close=close)


def main(argv: list[str] | None = None) -> None:
    serve_main(DraftConfig, "draft", build, argv)


if __name__ == "__main__":
    main(sys.argv[1:])

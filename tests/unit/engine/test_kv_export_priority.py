"""The engine's KV exports: background jobs (later hits, nobody waits) on a thread in Linux's idle
scheduling class, bounded in bytes; urgent jobs (P/D handoffs, ingests) on a normal-priority
thread of their own, never queued behind background work. The KV-cache service is a fake writer."""
from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from kvmesh.kv import codec
from kvmesh.kv.namespace import KvLayout, KvNamespace
from kvmesh.model.llama import RotaryEmbedding
from kvmesh.services.engine import kv_connector
from kvmesh.services.engine.kv_connector import ExportJob, KvConnector, KvConnectorConfig
from kvmesh.threads import lower_thread_priority

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
CHUNK = 16
LAYOUT = KvLayout(2, 1, 8, "float32")
NS = KvNamespace("model", LAYOUT)


class FakeWriter:
    """Records Puts; a Put of a key in `hold` waits until that key's event is set."""

    puts: list[bytes] = []
    hold: dict[bytes, threading.Event] = {}
    lock = threading.Lock()

    def __init__(self, address: str) -> None:
        self.address = address

    def put(self, key: bytes, blob: bytes, namespace: KvNamespace) -> None:
        if key in self.hold:
            assert self.hold[key].wait(30)
        with self.lock:
            self.puts.append(key)

    def close(self) -> None:
        pass


@pytest.fixture
def connector(monkeypatch):
    FakeWriter.puts, FakeWriter.hold = [], {}
    monkeypatch.setattr(kv_connector, "KvcacheWriter", FakeWriter)
    made: list[KvConnector] = []

    def make(**config) -> KvConnector:
        conn = KvConnector(KvConnectorConfig("fake:1", CHUNK, codec.CodecSpec(name="fp32", zstd=False), **config),
                           layout=LAYOUT, dtype=torch.float32, block_size=CHUNK,
                           rotary=RotaryEmbedding(8, 10000.0), client=object())
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.stop_exports()


def job(key: bytes, *, urgent: bool = False, on_done=None) -> ExportJob:
    k = torch.randn(LAYOUT.num_layers, CHUNK, 1, 8)
    return ExportJob(NS, [key], list(range(CHUNK)), 0, k, k.clone(), positioned=True, urgent=urgent,
                     on_done=on_done)


def nbytes(j: ExportJob) -> int:
    return j.k.nbytes + j.v.nbytes


def thread_named(conn: KvConnector, name: str) -> threading.Thread:
    return next(t for t in conn._export_threads if t.name == name)


@LINUX
def test_lower_thread_priority_moves_only_the_calling_thread_to_the_idle_class():
    got: list[tuple[str, int]] = []

    def run() -> None:
        got.append((lower_thread_priority(), os.sched_getscheduler(0)))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got == [("idle", os.SCHED_IDLE)]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own thread is untouched


@LINUX
def test_background_exports_run_in_the_idle_class_and_urgent_ones_do_not(connector):
    conn = connector()
    assert conn.export_priority == "idle"
    assert os.sched_getscheduler(thread_named(conn, "kv-export").native_id) == os.SCHED_IDLE
    assert os.sched_getscheduler(thread_named(conn, "kv-export-urgent").native_id) == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


@LINUX
def test_normal_priority_leaves_the_background_thread_alone(connector):
    conn = connector(export_priority="normal")
    assert conn.export_priority == "normal"
    assert os.sched_getscheduler(thread_named(conn, "kv-export").native_id) == os.SCHED_OTHER


def test_an_urgent_job_is_not_queued_behind_a_stalled_background_job(connector):
    conn = connector()
    FakeWriter.hold[b"bg"] = release = threading.Event()
    urgent_done = threading.Event()
    conn.submit_export(job(b"bg"))
    conn.submit_export(job(b"hop", urgent=True, on_done=lambda ok: urgent_done.set()))
    assert urgent_done.wait(30)
    assert FakeWriter.puts == [b"hop"]  # stored while the background Put still waits
    release.set()
    assert conn.flush(30)
    assert FakeWriter.puts == [b"hop", b"bg"] and conn.stats.exported_chunks == 2


def test_background_jobs_past_the_byte_bound_are_dropped_and_counted(connector):
    one = nbytes(job(b"x"))
    conn = connector(max_export_bytes=2 * one)
    FakeWriter.hold[b"a"] = release = threading.Event()
    results: list[tuple[bytes, bool]] = []
    for key in (b"a", b"b", b"c"):  # a is taken by the thread but still holds its bytes while stored
        conn.submit_export(job(key, on_done=lambda ok, key=key: results.append((key, ok))))
    assert results == [(b"c", False)] and conn.stats.export_dropped == 1
    conn.submit_export(job(b"hop", urgent=True))  # urgent jobs are not counted against the bound
    release.set()
    assert conn.flush(30)
    assert sorted(FakeWriter.puts) == [b"a", b"b", b"hop"]
    assert conn._queued_bytes == 0  # every stored job gave its bytes back
    conn.submit_export(job(b"d"))  # room again
    assert conn.flush(30) and b"d" in FakeWriter.puts and conn.stats.export_dropped == 1

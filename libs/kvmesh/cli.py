"""The `kvmesh` command: run the stack, talk to it, benchmark it."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

DEFAULT_ENGINE = "127.0.0.1:50061"


def _cmd_up(args: argparse.Namespace) -> int:
    from kvmesh import launcher

    try:
        procs = launcher.up(args.engine_arg, port=args.engine_port, kvcache_port=args.kvcache_port,
                            kvcache_args=args.kvcache_arg)
    except launcher.LaunchError as err:
        print(f"kvmesh up: {err}", file=sys.stderr)
        return 1
    for p in procs:
        print(f"{p.name:8s} pid {p.pid:<7d} {p.address}  log {p.log}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from kvmesh import launcher

    stopped = launcher.down()
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from kvmesh import launcher

    procs = launcher.load_state()
    if not procs:
        print("the local stack is not running ('kvmesh up' starts it)")
        return 3
    worst = 0
    for p in procs:
        state = launcher.health(p.address) if launcher.alive(p.pid) else "EXITED"
        worst = worst or (state != "SERVING")
        print(f"{p.name:8s} pid {p.pid:<7d} {p.address:22s} {state}")
    return 1 if worst else 0


async def _stream(target: str, request, timeout_s: float):
    import grpc

    from kvmesh.engine.v1 import engine_pb2_grpc

    async with grpc.aio.insecure_channel(target) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        async for msg in stub.Generate(request, timeout=timeout_s):
            yield msg


def _cmd_chat(args: argparse.Namespace) -> int:
    """Sends one chat turn (the model's chat template) to the engine, streams the answer."""
    import grpc

    from kvmesh.engine.v1 import engine_pb2
    from kvmesh.model.loader import load_tokenizer

    tok = load_tokenizer(args.model)
    text = tok.apply_chat_template([{"role": "user", "content": args.message}],
                                   add_generation_prompt=True)
    req = engine_pb2.GenerateRequest(
        token_ids=engine_pb2.TokenIds(ids=tok.encode(text)),
        sampling=engine_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))

    async def run() -> int:
        t0 = time.perf_counter()
        final = None
        first = None
        n = 0
        async for msg in _stream(args.engine, req, args.timeout):
            if msg.token_ids and first is None:
                first = time.perf_counter()
            n += len(msg.token_ids)
            print(msg.text, end="", flush=True)
            if msg.HasField("final"):
                final = msg.final
        print()
        end = time.perf_counter()
        decode = (n - 1) / (end - first) if first and n > 1 and end > first else 0.0
        print(f"[{n} tokens · prompt {final.usage.prompt_tokens} tokens · time to first token "
              f"{(first or end) - t0:.3f}s · decode {decode:.1f} tok/s · end-to-end {end - t0:.2f}s]",
              file=sys.stderr)
        return 0

    try:
        return asyncio.run(run())
    except grpc.aio.AioRpcError as err:
        print(f"kvmesh chat: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvmesh.loadtest.registry import run_bench

    rows = run_bench(args.name, quick=args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {len(rows)} rows to {args.json}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start the local stack (detached) and wait until it is ready")
    up.add_argument("--engine-arg", action="append", default=[],
                    help="extra flag for the engine (repeatable), e.g. --engine-arg=--weights=int8")
    up.add_argument("--engine-port", type=int, default=50061, help="engine gRPC port")
    up.add_argument("--kvcache-arg", action="append", default=[],
                    help="extra flag for the KV-cache service (repeatable), e.g. --kvcache-arg=--memory-bytes=1073741824")
    up.add_argument("--kvcache-port", type=int, default=50071, help="KV-cache service gRPC port")
    up.set_defaults(fn=_cmd_up)
    sub.add_parser("down", help="stop the local stack gracefully").set_defaults(fn=_cmd_down)
    sub.add_parser("status", help="health of each local service").set_defaults(fn=_cmd_status)

    chat = sub.add_parser("chat", help="send one chat message to the engine and stream the answer")
    chat.add_argument("message")
    chat.add_argument("--engine", default=DEFAULT_ENGINE, help="engine gRPC address")
    chat.add_argument("--model", default="bundled", help="model source (for its tokenizer and chat template)")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    chat.set_defaults(fn=_cmd_chat)

    bench = sub.add_parser("bench", help="run a benchmark (see README: Benchmarks)")
    bench.add_argument("name", help="engine | quant | kvcache")
    bench.add_argument("--quick", action="store_true", help="shortened run (< 10 minutes)")
    bench.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    bench.set_defaults(fn=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

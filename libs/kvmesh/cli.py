"""The `kvmesh` command: run the stack, talk to it, benchmark it."""
from __future__ import annotations

import argparse
import json
import sys
import time

from kvmesh import __version__

def _cmd_up(args: argparse.Namespace) -> int:
    import os

    from kvmesh import launcher

    if args.otlp_endpoint:  # every service reads it (and the processes inherit this environment)
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = args.otlp_endpoint

    try:
        plan = _plan(args)
    except ValueError as err:
        print(f"kvmesh up: {err}", file=sys.stderr)
        return 2
    print("kvmesh up: starting the stack, one line per service as it becomes healthy", flush=True)
    try:
        procs = launcher.up(plan, progress=lambda line: print(f"  {line}", flush=True))
    except launcher.LaunchError as err:
        print(f"kvmesh up: {err}", file=sys.stderr)
        return 1
    for p in procs:
        print(f"{p.name:12s} pid {p.pid:<7d} {p.address:16s} {p.url or ''}  log {p.log}")
    return 0


def _plan(args: argparse.Namespace):
    """The StackPlan of `kvmesh up`'s flags; ValueError for a served name the router refuses."""
    from kvmesh import launcher

    return launcher.StackPlan(
        ports=launcher.StackPorts(http=args.http_port, gateway=args.gateway_port, router=args.router_port,
                                  engine=args.engine_port, kvcache=args.kvcache_port, draft=args.draft_port,
                                  metrics=args.metrics_port),
        replicas=args.replicas, pd=args.pd, pin_engines=args.pin_engines, cascade=args.cascade, engine_args=tuple(args.engine_arg),
        kvcache_args=tuple(args.kvcache_arg), draft_args=tuple(args.draft_arg), router_args=tuple(args.router_arg),
        gateway_args=tuple(args.gateway_arg), model=args.model, served_name=args.served_model_name or "",
        draft_model=args.draft_model or "", chat_template=args.chat_template or "")


def _pd_counts(text: str) -> tuple[int, int]:
    """`--pd P:D` → (P, D), each at least 1."""
    p, colon, d = text.partition(":")
    try:
        counts = (int(p), int(d)) if colon else None
    except ValueError:
        counts = None
    if counts is None or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--pd {text!r}: write PREFILL:DECODE engine counts, each >= 1, e.g. 1:1")
    return counts


def _cmd_down(args: argparse.Namespace) -> int:
    from kvmesh import launcher

    found = launcher.down()
    stopped = [name for name, c in found.items() if c.state is launcher.Liveness.RUNNING]
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    for name, c in found.items():
        if c.note:  # a stale entry (left alone), or an old entry matched by its command line
            print(f"{name}: {c.state.value}: {c.note}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from kvmesh import launcher

    procs = launcher.load_state()
    if not procs:
        print("the local stack is not running ('kvmesh up' starts it)")
        return 3
    worst = 0
    sup, sup_found = launcher.supervisor_pid(), launcher.supervisor_check()
    print(f"{'supervisor':12s} pid {sup:<7d} restarts a service that exits" if sup else
          f"{'supervisor':12s} NOT RUNNING: nothing restarts a service that exits ('kvmesh down; kvmesh up')")
    if sup_found.note:
        print(f"  {sup_found.state.value}: {sup_found.note}")
    for p in procs:
        found = p.check()  # by pid, start time and command line: a reused pid is STALE
        state = launcher.health(p.address) if found.state is launcher.Liveness.RUNNING else found.state.name
        worst = worst or (state != "SERVING")
        restarts = f"  restarts {p.restarts} (last: {p.last_exit})" if p.restarts or p.last_exit else ""
        metrics = f"  metrics {p.metrics}" if p.metrics else ""
        print(f"{p.name:12s} pid {p.pid:<7d} {p.address:22s} {state:12s} {p.url}{metrics}{restarts}")
        if found.note:
            print(f"  {found.state.value}: {found.note}")
        if p.name.startswith("engine") and state == "SERVING":
            for line in _guardrail_lines(p.address):
                print(line)
    return 1 if worst else 0


def _guardrail_lines(address: str, timeout_s: float = 2.0) -> list[str]:
    """The engine's guardrail state for `kvmesh status`, one line per lossy path; a line saying
    why when the engine does not answer (status never fails on it)."""
    import grpc

    from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            resp = engine_pb2_grpc.EngineServiceStub(ch).GetGuardrail(engine_pb2.GetGuardrailRequest(),
                                                                      timeout=timeout_s)
        except grpc.RpcError as err:
            return [f"  guardrail  not available ({err.code().name})"]
    return format_guardrail(resp)


def format_guardrail(resp) -> list[str]:
    """GetGuardrailResponse as `kvmesh status` lines."""
    from kvmesh.engine.v1 import engine_pb2

    if not resp.paths:
        return ["  guardrail  no lossy paths used"]
    lines = []
    for p in resp.paths:
        state = "enabled" if p.state == engine_pb2.GUARD_STATE_ENABLED else "DISABLED"
        tenant = p.namespace.tenant_salt or "default tenant"
        lines.append(f"  guardrail  {p.namespace.storage} {tenant}  {state}  {p.checks} checks  KL {p.kl:.4f}  "
                     f"top-1 {p.top1:.1%}  (budget KL <= {p.budget.max_kl:g}, top-1 >= {p.budget.min_top1:.0%})  "
                     f"served {p.served}  fallbacks {p.fallbacks}")
    if resp.pending_checks:
        lines.append(f"  guardrail  {resp.pending_checks} checks waiting for an idle engine")
    return lines


def _cmd_chat(args: argparse.Namespace) -> int:
    """Sends one chat turn through the gateway's OpenAI API and streams the answer."""
    import os

    import openai

    from kvmesh import launcher

    base_url = args.url or launcher.openai_base_url()
    if base_url is None:
        print("kvmesh chat: the local stack is not running ('kvmesh up' starts it) and no --url was given",
              file=sys.stderr)
        return 1
    client = openai.OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"),
                           timeout=args.timeout, max_retries=0)
    model = args.model or client.models.list().data[0].id
    t0 = time.perf_counter()
    first = None
    usage = None
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": args.message}], max_tokens=args.max_tokens,
            temperature=args.temperature, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter()
                    print(choice.delta.content, end="", flush=True)
    except openai.APIError as err:
        print(f"\nkvmesh chat: {err}", file=sys.stderr)
        return 1
    print()
    end = time.perf_counter()
    n = usage.completion_tokens if usage else 0
    decode = (n - 1) / (end - first) if first and n > 1 and end > first else 0.0
    cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
    print(f"[{model} · {n} tokens · prompt {usage.prompt_tokens if usage else '?'} tokens ({cached} cached) · "
          f"time to first token {(first or end) - t0:.3f}s · decode {decode:.1f} tok/s · "
          f"end-to-end {end - t0:.2f}s]", file=sys.stderr)
    return 0


def _stack_address(name: str, flag: str | None) -> str:
    from kvmesh import launcher

    if flag:
        return flag
    for p in launcher.load_state():
        if p.name == name or (name == "engine" and p.name == "engine-0"):
            return p.address
    raise SystemExit(f"kvmesh docs: no {name} in the local stack ('kvmesh up' starts it); or pass --{name}")


def _cmd_docs(args: argparse.Namespace) -> int:
    """The document catalog: ingest through the engine (it computes the KV), the rest in the KV
    service, in the namespace the engine reports for its model with the tenant's salt."""
    import grpc

    from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc
    from kvmesh.kv.namespace import tenant_salt
    from kvmesh.kvcache.v1 import kvcache_pb2 as kpb
    from kvmesh.kvcache.v1 import kvcache_pb2_grpc

    salt = tenant_salt(args.tenant, args.cache_namespace)
    with grpc.insecure_channel(_stack_address("engine", args.engine)) as ech:
        engine = engine_pb2_grpc.EngineServiceStub(ech)
        try:
            if args.action == "add":
                text = sys.stdin.read() if args.path == "-" else open(args.path, encoding="utf-8").read()
                meta = dict(kv.split("=", 1) for kv in args.meta)
                req = engine_pb2.IngestDocumentRequest(document_id=args.id, text=text, metadata=meta,
                                                       cache_salt=salt, pinned=args.pin)
                if args.ttl_s is not None:
                    req.ttl_s = args.ttl_s
                r = engine.IngestDocument(req, timeout=args.timeout)
                print(f"{args.id}: {r.tokens} tokens, {r.chunks} chunks ({r.reused_chunks} already stored)")
                return 0
            info = engine.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"kvmesh docs {args.action}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    ns = info.kv_namespace
    ns.tenant_salt = salt
    with grpc.insecure_channel(_stack_address("kvcache", args.kvcache)) as kch:
        catalog = kvcache_pb2_grpc.KvCatalogServiceStub(kch)
        try:
            if args.action == "list":
                token = ""
                while True:
                    page = catalog.ListDocuments(kpb.ListDocumentsRequest(namespace=ns, page_size=100,
                                                                          page_token=token), timeout=args.timeout)
                    for d in page.documents:
                        meta = " ".join(f"{k}={v}" for k, v in sorted(d.metadata.items()))
                        print(f"{d.document_id}\t{len(d.chunk_keys)} chunks\t{'pinned' if d.pinned else ''}\t{meta}")
                    token = page.next_page_token
                    if not token:
                        return 0
            if args.action == "search":
                resp = catalog.Search(kpb.SearchRequest(text=args.query, namespace=ns, kind=kpb.INDEX_KIND_DOCUMENT,
                                                        k=args.k), timeout=args.timeout)
                for h in resp.hits:
                    print(f"{h.score:.3f}\t{h.document_id}")
                return 0
            if args.action == "rm":
                r = catalog.DeleteDocument(kpb.DeleteDocumentRequest(namespace=ns, document_id=args.id),
                                           timeout=args.timeout)
                print(f"{args.id}: deleted ({r.deleted_chunks} chunks no other document used)")
                return 0
            catalog.PinDocument(kpb.PinDocumentRequest(namespace=ns, document_id=args.id, pinned=not args.off),
                                timeout=args.timeout)
            print(f"{args.id}: {'unpinned' if args.off else 'pinned'}")
            return 0
        except grpc.RpcError as err:
            print(f"kvmesh docs {args.action}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvmesh.loadtest.registry import run_bench

    rows = run_bench(args.name, quick=args.quick, json_path=args.json, model=args.model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {len(rows)} rows to {args.json}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start the local stack (detached) and wait until it is ready")
    up.add_argument("--model", default="bundled",
                    help="the model to serve: 'bundled' (SmolLM2-135M-Instruct), a .gguf file or a Hugging Face "
                         "folder of a Llama, Mistral or Qwen2 model; sets the engines, the gateway's tokenizer, "
                         "the router tier and the served name")
    up.add_argument("--served-model-name", help="the name clients use (default: --model as given; "
                                                "smollm2-135m-instruct for the bundled model)")
    up.add_argument("--draft-model", help="draft model for speculative decoding, sharing --model's tokenizer "
                                          "(default: the bundled model drafts for itself; other models get "
                                          "n-gram drafts only)")
    up.add_argument("--chat-template", help="chat template overriding the model's: a Jinja file or the template")
    up.add_argument("--replicas", type=int, default=1, help="engine replicas of the full model")
    up.add_argument("--pd", metavar="P:D", type=_pd_counts,
                    help="prefill/decode disaggregation: P prefill and D decode engines instead of --replicas "
                         "(long prompts are prefilled on one, decoded on the other, the KV moving through the "
                         "KV-cache service; short ones run whole on a decode engine), e.g. --pd 1:1")
    up.add_argument("--pin-engines", action="store_true",
                    help="pin each engine to its own CPUs (their share of this machine's, in order), so engines "
                         "never compete for a core")
    up.add_argument("--cascade", action="store_true",
                    help="also start a cheap tier (int4 weights) and a cascade route 'auto' over both tiers")
    for svc, example in (("engine", "--weights=int8"), ("kvcache", "--memory-bytes=1073741824"), ("draft", "--default-drafter=ngram"),
                         ("router", "--policy=round_robin"), ("gateway", "--keys-file=keys.json")):
        up.add_argument(f"--{svc}-arg", action="append", default=[],
                        help=f"extra flag for the {svc} (repeatable), e.g. --{svc}-arg={example}")
    for svc, port in (("http", 8000), ("gateway", 50051), ("router", 50081), ("engine", 50061),
                      ("kvcache", 50071), ("draft", 50091)):
        up.add_argument(f"--{svc}-port", type=int, default=port,
                        help=f"{svc} port" + (" (OpenAI API)" if svc == "http" else " (gRPC)"))
    up.add_argument("--metrics-port", type=int, default=0,
                    help="Prometheus /metrics of every service but the gateway (whose /metrics is on --http-port): "
                         "0 (default) gives each a free port, listed by `kvmesh status`; N gives them N, N+1, ... "
                         "in start order; -1 turns them off")
    up.add_argument("--otlp-endpoint", help="export every service's traces by OTLP/gRPC to this host:port "
                                           "(e.g. a local collector or Jaeger on 127.0.0.1:4317)")
    up.set_defaults(fn=_cmd_up)
    sub.add_parser("down", help="stop the local stack gracefully").set_defaults(fn=_cmd_down)
    sub.add_parser("status", help="health of each local service").set_defaults(fn=_cmd_status)

    chat = sub.add_parser("chat", help="send one chat message through the gateway and stream the answer")
    chat.add_argument("message")
    chat.add_argument("--url", help="OpenAI base URL (default: the running local stack's gateway)")
    chat.add_argument("--model", help="model name (default: the first the gateway lists)")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    chat.set_defaults(fn=_cmd_chat)

    docs = sub.add_parser("docs", help="the document catalog: add (KV computed by the engine), list, search, rm, pin")
    dsub = docs.add_subparsers(dest="action", required=True)
    add = dsub.add_parser("add", help="ingest a text file (or - for stdin) as document ID")
    add.add_argument("id")
    add.add_argument("path")
    add.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE", help="metadata (repeatable)")
    add.add_argument("--ttl-s", type=float, help="expire after this many seconds")
    add.add_argument("--pin", action="store_true", help="never evicted")
    dsub.add_parser("list", help="catalogued documents")
    search = dsub.add_parser("search", help="nearest documents to a query (semantic index)")
    search.add_argument("query")
    search.add_argument("-k", type=int, default=5)
    rm = dsub.add_parser("rm", help="delete a document (and chunks no other document uses)")
    rm.add_argument("id")
    pin = dsub.add_parser("pin", help="pin a document (--off: unpin)")
    pin.add_argument("id")
    pin.add_argument("--off", action="store_true")
    for sp in dsub.choices.values():
        sp.add_argument("--tenant", default="default",
                        help="the tenant whose documents these are, as named in the gateway's keys file "
                             "(default: the open local gateway's tenant)")
        sp.add_argument("--cache-namespace",
                        help="the tenant's cache_namespace in the keys file, when it shares KV with others")
        sp.add_argument("--engine", help="engine host:port (default: the local stack's)")
        sp.add_argument("--kvcache", help="KV-cache host:port (default: the local stack's)")
        sp.add_argument("--timeout", type=float, default=300.0)
        sp.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    docs.set_defaults(fn=_cmd_docs)

    bench = sub.add_parser("bench", help="run a benchmark (see README: Benchmarks)")
    bench.add_argument("name", help="engine | quant | kvcache | routing | cascade | spec | blend | quality | loadgen | "
                                    "gpu | pd (engine and gpu need packages of the test extra: checked before they start)")
    bench.add_argument("--quick", action="store_true", help="shortened run (< 10 minutes)")
    bench.add_argument("--model", default="bundled",
                       help="the model to measure: 'bundled' (SmolLM2-135M-Instruct), a .gguf file or a Hugging "
                            "Face folder, as `kvmesh up --model`; routing and cascade run on the bundled model "
                            "only, and a workload the model cannot run (longer than its context, blending past "
                            "a sliding window) is refused with the reason")
    bench.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    bench.set_defaults(fn=_cmd_bench)

    from kvmesh.loadtest.harness import cli as loadtest_cli

    loadtest_cli.add_parser(sub)
    sub.choices["loadtest"].set_defaults(fn=loadtest_cli.run)
    for sp in sub.choices.values():  # --version on every command, as on the services
        sp.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

"""Put a short load on a running compose stack, then screenshot Prometheus' graph page with the
dashboard's main series (headless Chromium, Debian package `chromium`) into loadtest/results/.

    .venv/bin/python scripts/compose-screenshot.py --key sk-... [--http-port 8000] [--prometheus-port 9090]

The load: a few concurrent chat requests, half of them repeating a long shared prefix, so TTFT,
TPOT, throughput, the queue and the KV hit rates all have something to show.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
QUERIES = [  # the dashboard's TTFT, TPOT, throughput, queue and KV hit-rate panels
    "histogram_quantile(0.95, sum by (le) (rate(kvmesh_engine_time_to_first_token_seconds_bucket[1m])))",
    "histogram_quantile(0.95, sum by (le) (rate(kvmesh_engine_request_time_per_output_token_seconds_bucket[1m])))",
    "sum(rate(kvmesh_engine_generation_tokens_total[1m]))",
    "sum(kvmesh_engine_num_requests_waiting) + sum(kvmesh_engine_num_requests_running)",
    "sum(rate(kvmesh_engine_prefix_cache_hits_total[1m])) / sum(rate(kvmesh_engine_prefix_cache_queries_total[1m]))",
]


def load(base_url: str, key: str, requests: int, concurrency: int) -> float:
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=2, timeout=300)
    shared = " ".join(f"Rule {i}: shipments to region {i % 9} leave on day {i % 7}." for i in range(60))

    def one(i: int) -> int:
        prompt = f"{shared}\nWhen do shipments to region {i % 9} leave?" if i % 2 else f"Name a fruit, {i}."
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=24, temperature=0)
        return out.usage.completion_tokens

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(requests)))
    elapsed = time.monotonic() - start
    print(f"load: {requests} requests, {tokens} tokens in {elapsed:.1f} s")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key", required=True, help="a gateway API key (keys add --tenant NAME)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--prometheus-port", type=int, default=9090)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "compose-prometheus.png")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("no chromium: apt-get install -y chromium")
    load(f"http://127.0.0.1:{args.http_port}/v1", args.key, args.requests, args.concurrency)
    time.sleep(12)  # two scrape intervals, so the last requests are in the graphs (not a sync point)
    params = {}
    for i, expr in enumerate(QUERIES):
        params.update({f"g{i}.expr": expr, f"g{i}.tab": "0", f"g{i}.range_input": "10m"})
    url = f"http://127.0.0.1:{args.prometheus_port}/graph?{urllib.parse.urlencode(params)}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1400,3600", "--virtual-time-budget=15000",
                    f"--screenshot={args.out}", url], check=True, capture_output=True, timeout=120)
    print(f"wrote {args.out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

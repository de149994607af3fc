"""Load benchmark of a running `merg serve`: 1, 8 and 64 concurrent streaming clients, each
sending the same number of chat requests back to back. Prints requests/s and p50/p99 latency
(and time to first token) per level, and each as a ratio to 1 client, all from one run.

usage: bench_serve.py BASE_URL MODEL [--requests-per-client N] [--max-tokens N]
"""

import argparse
import asyncio
import json
import statistics
import time

import httpx

PROMPTS = ["How was your day?", "I failed my exam.", "We got a puppy!", "My flight was cancelled again."]


async def one(client, url, model, prompt, max_tokens):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and ttft is None and '"content":""' not in line:
                ttft = time.perf_counter() - t0
    return time.perf_counter() - t0, ttft or 0.0


async def level(url, model, clients, per_client, max_tokens):
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker(c):
            return [await one(client, url, model, PROMPTS[(c + i) % len(PROMPTS)], max_tokens) for i in range(per_client)]
        t0 = time.perf_counter()
        results = [x for w in await asyncio.gather(*(worker(c) for c in range(clients))) for x in w]
        wall = time.perf_counter() - t0
    lat = sorted(r[0] for r in results)
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
    return {"clients": clients, "requests": len(results), "rps": len(results) / wall, "p50": q(0.5), "p99": q(0.99),
            "ttft_p50": statistics.median(r[1] for r in results)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("model")
    ap.add_argument("--requests-per-client", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    asyncio.run(level(a.url, a.model, 4, 1, a.max_tokens))  # warm-up
    rows = [asyncio.run(level(a.url, a.model, n, a.requests_per_client, a.max_tokens)) for n in (1, 8, 64)]
    base = rows[0]
    print(f"{'clients':>7} {'requests':>8} {'req/s':>8} {'x1':>6} {'p50 ms':>8} {'x1':>6} {'p99 ms':>8} {'x1':>6} {'ttft p50 ms':>11}")
    for r in rows:
        print(f"{r['clients']:>7} {r['requests']:>8} {r['rps']:>8.1f} {r['rps']/base['rps']:>6.2f} {r['p50']*1e3:>8.1f} "
              f"{r['p50']/base['p50']:>6.2f} {r['p99']*1e3:>8.1f} {r['p99']/base['p99']:>6.2f} {r['ttft_p50']*1e3:>11.1f}")
    print("json: " + json.dumps(rows))


main()

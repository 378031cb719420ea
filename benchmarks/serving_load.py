"""Serving load test: a concurrency sweep of streamed chat requests against a dllm-serve server.

    python benchmarks/serving_load.py                      # starts demo-llada on 127.0.0.1
    python benchmarks/serving_load.py --concurrency 1 4 16 64 --requests-per-level 128
    python benchmarks/serving_load.py --url http://127.0.0.1:8000   # an already running server
    python benchmarks/serving_load.py --model /models/LLaDA-8B-Instruct \
        --server-args="--device cuda"

For each concurrency level ``c``, ``n`` requests (``--requests-per-level``, default
``max(8, 2c)``) are sent through raw async httpx with at most ``c`` in flight. Every request is
a streamed chat completion with ``stream_options.include_usage``, so the answer length is the
server's own ``usage.completion_tokens`` (answer tokens, never canvas padding). Reported per
level: answer tokens/s over the level's wall time, time to first content (first chunk with
non-empty ``delta.content``) and end-to-end latency p50/p99, and mean rows per forward from the
``dllm:forward_rows_sum/_count`` deltas of ``/metrics`` around the level. Loopback only: a
``--url`` that is not 127.0.0.1/localhost is refused. Writes
``benchmarks/results/serving_load.json`` (+ ``.png`` with matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from dllm_serve.local_server import LocalServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    PROMPTS,
    RESULTS_DIR,
    at_least,
    finite_float,
    machine_info,
    ms,
    percentile,
    plot_if_available,
    write_json,
)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
STARTUP_TIMEOUT_S = 120


def start_server(model: str, extra: list[str], log: Path, threads: int = 0) -> LocalServer:
    """The real CLI on a free loopback port; ``threads`` caps the server's torch threads."""
    # torch reads OMP_NUM_THREADS at start: the CPU threads of the server's forwards.
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    args = ["--model", model, "--log-level", "warning", *extra]
    return LocalServer.start(args, log, env=env, timeout=STARTUP_TIMEOUT_S)


def scrape(metrics_text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of the samples of each unlabelled-or-labelled metric line named in ``names``."""
    found = dict.fromkeys(names, 0.0)
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in found:
            found[name] += float(line.rsplit(" ", 1)[1])
    return found


METRIC_NAMES = (
    "dllm:forward_rows_sum",
    "dllm:forward_rows_count",
    "dllm:forward_duration_seconds_sum",
    "dllm:engine_busy_seconds_total",
)


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One streamed chat completion; times are measured from just before the POST."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.steps:
        body["num_denoising_steps"] = args.steps
    if args.block_length:
        body["block_length"] = args.block_length
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] | None = None
    finish: str | None = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return {"ok": False, "status": resp.status_code, "error": resp.text[:200]}
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return {"ok": False, "status": 200, "error": str(chunk["error"])[:200]}
                for choice in chunk.get("choices") or []:
                    if choice["delta"].get("content") and first is None:
                        first = time.perf_counter() - start
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as exc:
        return {"ok": False, "status": None, "error": f"{type(exc).__name__}: {exc}"}
    return {
        "ok": usage is not None,
        "ttfc_s": first,
        "e2e_s": time.perf_counter() - start,
        "completion_tokens": usage["completion_tokens"] if usage else 0,
        "prompt_tokens": usage["prompt_tokens"] if usage else 0,
        "finish_reason": finish,
    }


async def run_level(
    client: httpx.AsyncClient, model: str, concurrency: int, n: int, args: argparse.Namespace
) -> dict[str, Any]:
    """``n`` requests with at most ``concurrency`` in flight; metrics deltas around them."""
    before = scrape((await client.get("/metrics")).text, METRIC_NAMES)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(PROMPTS[i % len(PROMPTS)])
    results: list[dict[str, Any]] = []
    deadline = time.perf_counter() + args.max_seconds_per_level

    async def worker() -> None:
        # Workers, not one task per request: exactly `concurrency` requests are in flight,
        # and a level past its time budget stops starting new ones (bounded in time).
        while not queue.empty() and time.perf_counter() < deadline:
            prompt = queue.get_nowait()
            results.append(await one_request(client, model, prompt, args))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    after = scrape((await client.get("/metrics")).text, METRIC_NAMES)
    delta = {k: after[k] - before[k] for k in METRIC_NAMES}
    ok = [r for r in results if r["ok"]]
    ttfc = [r["ttfc_s"] for r in ok if r["ttfc_s"] is not None]
    e2e = [r["e2e_s"] for r in ok]
    answer = sum(r["completion_tokens"] for r in ok)
    forwards = delta["dllm:forward_rows_count"]
    return {
        "concurrency": concurrency,
        "requests_sent": len(results),
        "requests_ok": len(ok),
        "errors": [r for r in results if not r["ok"]][:5],
        "wall_s": round(wall, 3),
        "answer_tokens": answer,
        "answer_tokens_per_s": round(answer / wall, 2) if wall else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall else None,
        "ttfc_ms": {"p50": ms(percentile(ttfc, 50)), "p99": ms(percentile(ttfc, 99))},
        "e2e_ms": {"p50": ms(percentile(e2e, 50)), "p99": ms(percentile(e2e, 99))},
        "forwards": int(forwards),
        "mean_rows_per_forward": (
            round(delta["dllm:forward_rows_sum"] / forwards, 3) if forwards else None
        ),
        # Share of engine-busy time spent inside the model forward (docs/metrics.md).
        "model_share_of_engine_time": (
            round(delta["dllm:forward_duration_seconds_sum"] / busy, 3)
            if (busy := delta["dllm:engine_busy_seconds_total"]) > 0
            else None
        ),
    }


async def sweep(url: str, args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    """Warm up once, then every concurrency level in order."""
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await one_request(client, model, PROMPTS[0], args)  # first-request costs off the books
        levels = []
        for c in args.concurrency:
            n = args.requests_per_level or max(8, 2 * c)
            n = min(n, args.max_requests_per_level)
            level = await run_level(client, model, c, n, args)
            levels.append(level)
            print(
                f"c={c:3d}  n={level['requests_ok']:3d}/{n:3d}  "
                f"{level['answer_tokens_per_s']} answer tok/s  TTFC p50/p99 "
                f"{level['ttfc_ms']['p50']}/{level['ttfc_ms']['p99']} ms  e2e p50/p99 "
                f"{level['e2e_ms']['p50']}/{level['e2e_ms']['p99']} ms  rows/fwd "
                f"{level['mean_rows_per_forward']}"
            )
        return model, levels


def draw(levels: list[dict[str, Any]]) -> Any:
    """Throughput and latency against concurrency, side by side."""

    def _draw(plt: Any) -> None:
        conc = [lv["concurrency"] for lv in levels]
        _fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.plot(conc, [lv["answer_tokens_per_s"] for lv in levels], "o-")
        a.set(xscale="log", xlabel="concurrency", ylabel="answer tokens/s", title="throughput")
        for key, style in (("ttfc_ms", "--"), ("e2e_ms", "-")):
            for q in ("p50", "p99"):
                b.plot(conc, [lv[key][q] for lv in levels], style, marker="o", label=f"{key} {q}")
        b.set(xscale="log", xlabel="concurrency", ylabel="ms", title="latency")
        b.legend()

    return _draw


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running server (loopback only)")
    parser.add_argument("--model", default="demo-llada", help="model to start (without --url)")
    parser.add_argument("--server-args", default="", help="extra dllm-serve arguments, one string")
    parser.add_argument(
        "--server-threads", type=at_least(0), default=0, help="OMP_NUM_THREADS of a started server"
    )
    parser.add_argument("--concurrency", type=at_least(1), nargs="+", default=[1, 4, 16, 64])
    parser.add_argument(
        "--requests-per-level", type=at_least(0), default=0, help="default: max(8, 2 x concurrency)"
    )
    parser.add_argument("--max-requests-per-level", type=at_least(1), default=256)
    parser.add_argument("--max-seconds-per-level", type=finite_float, default=120.0)
    parser.add_argument(
        "--max-tokens", type=at_least(1), default=32, help="canvas length (gen_length)"
    )
    parser.add_argument(
        "--steps", type=at_least(0), default=0, help="num_denoising_steps (0: default)"
    )
    parser.add_argument("--block-length", type=at_least(0), default=0, help="0: server default")
    parser.add_argument("--timeout", type=finite_float, default=300.0, help="per request, seconds")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "serving_load.json")
    args = parser.parse_args(argv)

    server = None
    if args.url:
        host = urlparse(args.url).hostname
        if host not in LOOPBACK:
            parser.error(f"--url must be a loopback address, got {host!r}")
        url = args.url.rstrip("/")
    else:
        extra = args.server_args.split()
        if "--max-running-requests" not in extra:
            # Let the largest level run at once, so the sweep measures batching, not queueing.
            extra += ["--max-running-requests", str(max(args.concurrency))]
        log = Path(tempfile.mkstemp(prefix="serving_load_", suffix=".log")[1])
        server = start_server(args.model, extra, log, args.server_threads)
        url = server.url
    try:
        model, levels = asyncio.run(sweep(url, args))
    except httpx.TransportError as exc:  # nothing listens there, or the server went away
        parser.exit(1, f"serving_load: cannot reach {url}: {exc!r}\n")
    finally:
        if server is not None:
            server.stop()
    report = {
        "benchmark": "serving_load",
        "model": model,
        "random_weights": model.startswith("tiny-"),
        "server": "external" if args.url else f"started: {args.model} {args.server_args}".strip(),
        "server_threads": args.server_threads or None,
        "client": "httpx async, streamed chat, stream_options.include_usage",
        "max_tokens": args.max_tokens,
        "num_denoising_steps": args.steps or None,
        "block_length": args.block_length or None,
        "machine": machine_info(),
        "levels": levels,
    }
    write_json(args.out, report)
    plot_if_available(args.out.with_suffix(".png"), draw(levels))
    failed = [lv["concurrency"] for lv in levels if not lv["requests_ok"]]
    if failed:  # the JSON keeps the errors; a level that measured nothing is not a result
        parser.exit(1, f"serving_load: no request succeeded at concurrency {failed}\n")
    return report


if __name__ == "__main__":
    main()

"""Continuous batching through the real server: isolation, sharing, aborts, backpressure."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from remote_server import RemoteServer

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def metric(server: RemoteServer, name: str, labels: dict[str, str] | None = None) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels is None or labels.items() <= sample.labels.items()):
                return sample.value
    return 0.0


def request_variants() -> list[dict]:
    variants = []
    for i in range(16):
        canvas = (8, 16, 24, 32)[i % 4]
        body: dict = {"max_tokens": canvas, "num_denoising_steps": canvas // 2}
        if i % 3:
            body["temperature"] = 0.5 + 0.1 * i
            body["seed"] = 1000 + i
        if i % 4 == 1:
            body["block_length"] = canvas // 2
        variants.append(body)
    return variants


async def stream_once(client: openai.AsyncOpenAI, body: dict, content: str) -> str:
    extra = {k: v for k, v in body.items() if k not in ("max_tokens", "temperature", "seed")}
    stream = await client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": content}],
        stream=True,
        max_tokens=body["max_tokens"],
        temperature=body.get("temperature", openai.NOT_GIVEN),
        seed=body.get("seed", openai.NOT_GIVEN),
        extra_body=extra,
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


def test_sixteen_concurrent_streams_equal_each_alone(server: RemoteServer) -> None:
    variants = request_variants()
    prompts = [f"question {i}" for i in range(16)]

    def client() -> openai.AsyncOpenAI:  # one per event loop: httpx pools are loop-bound
        return openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60
        )

    async def alone() -> list[str]:
        c = client()
        return [await stream_once(c, b, p) for b, p in zip(variants, prompts, strict=True)]

    async def together() -> list[str]:
        c = client()
        coros = (stream_once(c, b, p) for b, p in zip(variants, prompts, strict=True))
        return list(await asyncio.gather(*coros))

    expected = asyncio.run(alone())
    rows_before = metric(server, "dllm:forward_rows_sum")
    forwards_before = metric(server, "dllm:forward_rows_count")
    got = asyncio.run(together())
    assert got == expected
    rows = metric(server, "dllm:forward_rows_sum") - rows_before
    forwards = metric(server, "dllm:forward_rows_count") - forwards_before
    assert rows / forwards > 1  # the concurrent requests really shared forwards


def test_staggered_arrivals_share_forwards(server: RemoteServer) -> None:
    client = server.client()
    before = (metric(server, "dllm:forward_rows_sum"), metric(server, "dllm:forward_rows_count"))
    results: list[str] = []

    def one(i: int) -> None:
        out = client.chat.completions.create(
            model="x", messages=MESSAGES, max_tokens=64, extra_body={"num_denoising_steps": 64}
        )
        results.append(out.choices[0].finish_reason)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.03)  # arrive while the others are mid-generation
    for t in threads:
        t.join(60)
    assert len(results) == 4
    rows = metric(server, "dllm:forward_rows_sum") - before[0]
    forwards = metric(server, "dllm:forward_rows_count") - before[1]
    assert rows / forwards > 1


def test_disconnected_stream_is_aborted_and_slot_reused(server: RemoteServer) -> None:
    aborted_before = metric(server, "dllm:request_success_total", {"finished_reason": "abort"})
    body = {"messages": MESSAGES, "stream": True, "max_tokens": 512, "num_denoising_steps": 512}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        next(response.iter_lines())  # the stream has started; now hang up
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        aborted = metric(server, "dllm:request_success_total", {"finished_reason": "abort"})
        if aborted > aborted_before and metric(server, "dllm:num_requests_running") == 0:
            break
        time.sleep(0.05)
    assert aborted == aborted_before + 1
    assert metric(server, "dllm:num_requests_running") == 0
    out = server.client().chat.completions.create(model="x", messages=MESSAGES, max_tokens=8)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_health_stays_fast_during_a_long_generation(server: RemoteServer) -> None:
    client = server.client()
    done = threading.Event()

    def long_request() -> None:
        client.chat.completions.create(
            model="x", messages=MESSAGES, max_tokens=512, extra_body={"num_denoising_steps": 512}
        )
        done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.2)
    latencies = []
    with httpx.Client(timeout=10) as http:
        while not done.is_set() and len(latencies) < 20:
            started = time.perf_counter()
            assert http.get(f"{server.url}/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
    thread.join(60)
    assert len(latencies) >= 5
    assert statistics.median(latencies) < 0.05


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    log = tmp_path_factory.mktemp("tight") / "server.log"
    srv = RemoteServer.start(
        ["--max-running-requests", "1", "--max-waiting-requests", "1", "--log-level", "warning"],
        log,
    )
    yield srv
    srv.stop()


def test_waiting_limit_gives_429_and_loses_nothing(tight_server: RemoteServer) -> None:
    client = openai.AsyncOpenAI(
        base_url=f"{tight_server.url}/v1", api_key="x", max_retries=0, timeout=60
    )

    async def one() -> tuple[int, str | None]:
        try:
            out = await client.chat.completions.create(
                model="x",
                messages=MESSAGES,
                max_tokens=256,
                extra_body={"num_denoising_steps": 256},
            )
            return 200, out.choices[0].finish_reason
        except openai.RateLimitError as exc:
            assert exc.response.headers["retry-after"] == "1"
            assert exc.body["code"] == "rate_limit_exceeded"
            return 429, None

    async def burst() -> list[tuple[int, str | None]]:
        return list(await asyncio.gather(*(one() for _ in range(6))))

    results = asyncio.run(burst())
    statuses = [status for status, _ in results]
    # One runs, one waits, the rest are refused at once; a request that finishes before the
    # last ones arrive frees its slot, so only the lower bounds are exact.
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1
    assert statuses.count(200) + statuses.count(429) == 6
    assert all(reason in ("stop", "length") for status, reason in results if status == 200)
    rejected = metric(tight_server, "dllm:requests_rejected_total", {"reason": "queue_full"})
    assert rejected == statuses.count(429)

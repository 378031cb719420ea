"""Prometheus metrics (``/metrics``), fed by the engine through the EngineObserver hooks.

Names follow vLLM's with a ``dllm:`` prefix. Each app gets its own registry, so several servers
in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dllm_serve.engine.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class Metrics:
    """All metric objects, and the observer methods the engine calls."""

    def __init__(
        self,
        num_running: Callable[[], int],
        num_waiting: Callable[[], int],
        kv_cache_bytes: Callable[[], int] = lambda: 0,
        kv_pages: Callable[[], tuple[int, int]] = lambda: (0, 0),
        prefix_pages: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("dllm:num_requests_running", "Requests being denoised.", registry=r)
        self.running.set_function(num_running)
        self.waiting = Gauge("dllm:num_requests_waiting", "Requests queued.", registry=r)
        self.waiting.set_function(num_waiting)
        self.kv_cache_bytes = Gauge(
            "dllm:kv_cache_bytes",
            "Bytes of the KV pool reserved by running requests (0 when idle).",
            registry=r,
        )
        self.kv_cache_bytes.set_function(kv_cache_bytes)
        self.kv_pages_used = Gauge(
            "dllm:kv_cache_pages_used",
            "KV-pool pages requests hold now (their contexts; 0 when idle).",
            registry=r,
        )
        self.kv_pages_used.set_function(lambda: kv_pages()[0])
        self.kv_pages_total = Gauge(
            "dllm:kv_cache_pages_total", "KV-pool pages (0 without a pool).", registry=r
        )
        self.kv_pages_total.set_function(lambda: kv_pages()[1])
        self.prefix_pages = Gauge(
            "dllm:prefix_cache_pages",
            "KV-pool pages the prefix cache holds (pinned by running requests or idle).",
            registry=r,
        )
        self.prefix_pages.set_function(lambda: prefix_pages()[0])
        self.prefix_pages_idle = Gauge(
            "dllm:prefix_cache_pages_idle",
            "Prefix-cache pages no running request pins (evicted LRU when pages run short).",
            registry=r,
        )
        self.prefix_pages_idle.set_function(lambda: prefix_pages()[1])
        self.success = Counter(
            "dllm:request_success",
            "Finished requests by finish reason (stop, length, abort, timeout, error).",
            ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "dllm:requests_rejected", "Requests refused before running.", ["reason"], registry=r
        )
        self.structured = Counter(
            "dllm:structured_output_requests",
            "Requests whose response_format (json_object / json_schema) is enforced.",
            registry=r,
        )
        self.prompt_tokens = Counter("dllm:prompt_tokens", "Prompt tokens.", registry=r)
        self.generation_tokens = Counter(
            "dllm:generation_tokens", "Answer tokens (no canvas padding).", registry=r
        )
        self.ttfc = Histogram(
            "dllm:time_to_first_content_seconds",
            "Arrival to the first answer token made final (the first text delta of a stream).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "dllm:e2e_request_latency_seconds",
            "Arrival to the last output.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.forward_rows = Histogram(
            "dllm:forward_rows", "Rows (requests) per forward.", buckets=ROW_BUCKETS, registry=r
        )
        self.forward_duration = Histogram(
            "dllm:forward_duration_seconds",
            "Wall time of one model forward.",
            buckets=FORWARD_BUCKETS,
            registry=r,
        )
        self.forward_tokens = Counter(
            "dllm:forward_tokens", "Tokens fed to the model (flat batches: no padding).", registry=r
        )
        self.graph_replays = Counter(
            "dllm:forward_graph_replays",
            "Forwards that replayed a captured CUDA graph (the rest ran eagerly).",
            registry=r,
        )
        self.busy = Counter(
            "dllm:engine_busy_seconds",
            "Wall time of engine iterations that had work; minus model time = overhead.",
            registry=r,
        )
        self.tokens_per_forward = Histogram(
            "dllm:request_tokens_per_forward",
            "Canvas tokens committed per forward pass, per finished request.",
            buckets=(0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=r,
        )
        self.spec_drafted = Counter(
            "dllm:spec_decode_num_draft_tokens",
            "Self-speculation (I-DLM ISD, LinearSpec): drafted tokens verified.",
            registry=r,
        )
        self.spec_accepted = Counter(
            "dllm:spec_decode_num_accepted_tokens",
            "Self-speculation (I-DLM ISD, LinearSpec): drafted tokens accepted (rate = accepted "
            "/ draft).",
            registry=r,
        )
        self.prefix_queries = Counter(
            "dllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (requests started with it on).",
            registry=r,
        )
        self.prefix_hits = Counter(
            "dllm:prefix_cache_hits",
            "Prompt tokens whose K/V came from the prefix cache (hit rate = hits / queries).",
            registry=r,
        )
        self.request_forwards = Histogram(
            "dllm:request_forwards",
            "Forward passes (NFE) per finished request.",
            buckets=COUNT_BUCKETS,
            registry=r,
        )

    # ---- EngineObserver ----------------------------------------------------------------------
    def on_forward(self, rows: int, tokens: int, model_seconds: float, graphed: bool) -> None:
        if graphed:
            self.graph_replays.inc()
        self.forward_rows.observe(rows)
        self.forward_duration.observe(model_seconds)
        self.forward_tokens.inc(tokens)

    def on_iteration(self, busy_seconds: float) -> None:
        self.busy.inc(busy_seconds)

    def on_first_content(self, seconds_since_arrival: float) -> None:
        self.ttfc.observe(seconds_since_arrival)

    def on_prefix_cache(self, queried: int, hit: int) -> None:
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)

    def on_finished(self, output: RequestOutput, seconds_since_arrival: float) -> None:
        self.success.labels(output.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(output.prompt_tokens)
        self.generation_tokens.inc(output.completion_tokens)
        self.e2e.observe(seconds_since_arrival)
        self.request_forwards.observe(output.nfe)
        if output.nfe:
            self.tokens_per_forward.observe(output.committed / output.nfe)
        if output.drafted is not None:
            self.spec_drafted.inc(output.drafted)
            self.spec_accepted.inc(output.accepted_drafts or 0)

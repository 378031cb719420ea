"""Prefix reuse through a real dllm-serve on 127.0.0.1 and the openai SDK (max_retries=0): a
tri-mode checkpoint with its draft LoRA (LinearSpec drafts in the LoRA view over cached pages
of the verify view) serves a long system prompt and a four-turn conversation with the cache on
(the default) exactly as a server with ``--no-enable-prefix-caching`` does; ``usage`` reports
the hit as ``prompt_tokens_details.cached_tokens`` (streamed too), and ``/metrics`` counts the
queries and hits in tokens while the tokens fed to the model drop by exactly the hits."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import httpx
import pytest
from remote_server import RemoteServer

from dllm_serve_train.tiny_checkpoints import write_tiny_nemotron

SYSTEM = "You are a terse assistant who answers arithmetic questions. " * 8
QUESTIONS = ["What is 2 + 2?", "And 3 + 5?", "Reverse the word cat.", "Say hi."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = Path(tmp_path_factory.mktemp("nemotron"))
    path = write_tiny_nemotron(root / "tiny-nemotron", block_size=8, seed=1,
                               draft_lora_out=root / "lora")  # fmt: skip
    return path, root / "lora"


def metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def converse(server: RemoteServer) -> list[tuple[str, int, int]]:
    """Four users sharing the system prompt, then a four-turn conversation; each answer with
    its prompt tokens and cached tokens (the last turn streamed, usage included)."""
    client = server.client()
    out = []
    for i, question in enumerate(QUESTIONS):  # four users, one question each
        reply = client.chat.completions.create(
            model="m",
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"User {i}: {question}"}],
            max_tokens=12,
        )  # fmt: skip
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        out.append((reply.choices[0].message.content or "", usage.prompt_tokens, cached))
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        if turn < 3:
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=12)
            usage = reply.usage
            text = reply.choices[0].message.content or ""
        else:
            chunks = list(
                client.chat.completions.create(
                    model="m", messages=messages, max_tokens=12, stream=True,
                    stream_options={"include_usage": True},
                )
            )  # fmt: skip
            usage = chunks[-1].usage
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert usage is not None and usage.prompt_tokens_details is not None
        out.append((text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0))
        messages.append({"role": "assistant", "content": text})
    return out


def test_the_cache_changes_no_answer_and_reports_its_hits(
    checkpoint: tuple[Path, Path], tmp_path: Path
) -> None:
    path, lora = checkpoint
    base = ["--model", str(path), "--draft-lora", str(lora), "--log-level", "warning"]
    results, fed, counters = {}, {}, {}
    for on in (True, False):
        flag = [] if on else ["--no-enable-prefix-caching"]
        server = RemoteServer.start([*base, *flag], tmp_path / f"log-{on}")
        try:
            results[on] = converse(server)
            fed[on] = metric(server, "dllm:forward_tokens_total")
            counters[on] = (
                metric(server, "dllm:prefix_cache_queries_total"),
                metric(server, "dllm:prefix_cache_hits_total"),
            )
            # Idle again: nothing held by a request, every cached page idle (none without it).
            cached = metric(server, "dllm:prefix_cache_pages")
            assert metric(server, "dllm:kv_cache_pages_used") == 0
            assert metric(server, "dllm:prefix_cache_pages_idle") == cached
            assert (cached > 0) is on
        finally:
            server.stop()
    on, off = results[True], results[False]
    assert [(t, p) for t, p, _ in on] == [(t, p) for t, p, _ in off]  # the same answers
    assert all(c == 0 for _, _, c in off) and counters[False] == (0.0, 0.0)
    hits = [c for _, _, c in on]
    # The first request fills the cache; every later one starts with the system prompt's
    # full pages at least (the first user's prompt ends in its own words, after them).
    system_pages = on[0][1] // 16 * 16 - 16
    assert hits[0] == 0 and all(h >= system_pages > 0 for h in hits[1:])
    assert all(h % 16 == 0 and h < p for _, p, h in on)
    # Conversation turns hit the earlier turns (prompt and answer) too.
    for (_, before, _), (_, prompt, hit) in itertools.pairwise(on[4:]):
        assert prompt > before and hit >= (before - 1) // 16 * 16
    assert counters[True] == (float(sum(p for _, p, _ in on)), float(sum(hits)))
    assert fed[False] - fed[True] == sum(hits)

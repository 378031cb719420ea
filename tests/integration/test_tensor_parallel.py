"""Tensor parallelism on CPU with gloo, 2 processes on loopback: TP=2 gives exactly the tokens
of TP=1 (fp32) — LLaDA, Dream (q/k/v biases), I-DLM (q/k norm; also one KV head replicated
on both ranks), Nemotron tri-mode with a draft LoRA — greedy and seeded; models that do not
shard are refused before any process starts; through a real server the openai SDK is served
end to end, and a killed worker makes the server answer 503 (/health and new requests), then
exit with status 1 within seconds."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from remote_server import RemoteServer, free_port

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.parallel.group import FAILURE_GRACE_S, STALE_S, STORE_TIMEOUT_S, VocabTraffic
from dllm_serve.engine.parallel.vocab import STATISTICS
from dllm_serve.engine.workers import launch
from dllm_serve.llm import LLM
from dllm_serve.models.checkpoint_files import read_json
from dllm_serve.models.errors import ModelLoadError
from dllm_serve_train.tiny_checkpoints import write_tiny, write_tiny_nemotron

QUESTIONS = ["What is 2 + 2?", "Reverse the word cat.", "Sort the letters of dcba."]


def generate(
    model: str, size: int, params: list[DecodingParams], lora: str | None = None, ep: bool = False
) -> tuple[list, VocabTraffic | None]:
    """Each conversation's (text, NFE, accepted drafts), and at TP > 1 what the vocab-parallel
    sampler brought to rank 0."""
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    traffic = None
    if size == 1:
        llm = LLM(model, device="cpu", dtype="float32", draft_lora=lora)
    elif lora:
        # The public path: LLM attaches the adapter to rank 0, the workers their own shares
        # (found by QA: rank 0 had none, so TP 2 drafted with half an adapter).
        llm = LLM(model, device="cpu", dtype="float32", tensor_parallel_size=size,
                  draft_lora=lora)  # fmt: skip
        # Rank 0's shard carries its share (random weights accept too few drafts for the
        # tokens alone to show a missing share).
        assert all(layer.attn.draft_lora is not None for layer in llm.loaded.model.layers)
        traffic = llm.loaded.parallel.traffic
    else:
        loaded = launch(model, "cpu", "float32", size, threads=1, expert_parallel=ep)
        traffic = loaded.parallel.traffic
        llm = LLM.from_loaded(loaded)
    with llm:
        outs = llm.generate(conversations, params)
        return [(c.text, c.nfe, c.accepted_drafts) for c in outs], traffic


def both(
    model: str, params: DecodingParams, lora: str | None = None, ep: bool = False
) -> tuple[list, VocabTraffic]:
    """TP=2 gives TP=1's tokens for a greedy, a seeded and a greedy row (returned, with the
    sampler's traffic); the logits are never gathered whole except for the rows a rule needs
    them for, so everything else reached rank 0 as 6 float64 statistics per position."""
    seeded = dataclasses.replace(params, temperature=0.8, seed=7)
    rows = [params, seeded, params]
    one, _ = generate(model, 1, rows, lora)
    two, traffic = generate(model, 2, rows, lora, ep)
    assert two == one
    assert any(text for text, *_ in one)
    assert traffic is not None and traffic.reduced_positions > 0
    vocab = read_json(Path(model) / "config.json")["vocab_size"]
    whole_rows = traffic.bytes - traffic.reduced_positions * STATISTICS * 8
    assert whole_rows % (vocab // 2 * 4) == 0  # float32 halves of the vocabulary, per position
    return one, traffic


def test_the_denoising_sampler_never_gathers_the_vocabulary(tmp_path: Path) -> None:
    """LLaDA (greedy and Gumbel-sampled rows): only statistics cross, 6 float64 per position
    and step; I-DLM: only the seeded row's rounds are gathered whole (its speculative
    verification needs p and q), one row per round."""
    llada = write_tiny("llada", tmp_path / "llada", seed=5)
    _, traffic = both(str(llada), DecodingParams(gen_length=16, steps=16))
    assert traffic.dense_rows == 0
    assert traffic.bytes == traffic.reduced_positions * STATISTICS * 8
    idlm = write_tiny("idlm", tmp_path / "idlm", seed=5)
    outs, traffic = both(str(idlm), DecodingParams(gen_length=16, steps=16))
    seeded_rounds = outs[1][1]
    assert traffic.dense_rows == seeded_rounds > 0


@pytest.mark.parametrize(
    ("family", "sizes"),
    [
        ("llada", {}),
        ("dream", {}),
        ("idlm", {}),
        ("idlm", {"n_kv_heads": 1}),  # fewer KV heads than ranks: replicated
    ],
)
def test_tp2_gives_the_tokens_of_tp1(family: str, sizes: dict, tmp_path: Path) -> None:
    path = write_tiny(family, tmp_path / family, seed=5, **sizes)
    both(str(path), DecodingParams(gen_length=16, steps=16))


def test_tp2_tri_mode_with_draft_lora(tmp_path: Path) -> None:
    path = write_tiny_nemotron(tmp_path / "nemotron", block_size=4, seed=2,
                               draft_lora_out=tmp_path / "lora")  # fmt: skip
    for mode in ("linear_spec", "diffusion"):
        params = DecodingParams(gen_length=12, steps=12, decoding_mode=mode)
        both(str(path), params, lora=str(tmp_path / "lora"))


@pytest.mark.parametrize("family", ["llada2", "lladamoe"])
@pytest.mark.parametrize("ep", [False, True], ids=["experts-sliced", "expert-parallel"])
def test_tp2_mixture_of_experts(family: str, ep: bool, tmp_path: Path) -> None:
    """LLaDA2 (fused q/k/v, sigmoid group-limited routing, shared expert) and LLaDA-MoE
    (softmax routing): experts sliced over both ranks, or split between them (EP=2)."""
    path = write_tiny(family, tmp_path / family, seed=4)
    both(str(path), DecodingParams(gen_length=8, steps=8), ep=ep)


@pytest.mark.parametrize(
    ("family", "sizes", "ep", "needle"),
    [
        ("llada", {"n_heads": 3, "d_model": 48}, False, "attention heads (3)"),
        ("llada", {}, True, "applies to mixture-of-experts models only"),
    ],
)
def test_models_that_do_not_shard_are_refused(
    family: str, sizes: dict, ep: bool, needle: str, tmp_path: Path
) -> None:
    path = write_tiny(family, tmp_path / family, **sizes)
    with pytest.raises(ModelLoadError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        launch(str(path), "cpu", "float32", 2, expert_parallel=ep)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def test_server_with_tp2_serves_the_sdk_and_dies_with_a_worker(tmp_path: Path) -> None:
    server = RemoteServer.start(
        ["--model", "demo-llada", "--tensor-parallel-size", "2", "--log-level", "warning"],
        tmp_path / "log",
    )
    try:
        client = server.client()
        reply = client.chat.completions.create(
            model="demo-llada",
            messages=[{"role": "user", "content": "What is 123 + 456?"}],
            temperature=0,
        )
        assert reply.choices[0].message.content == "123 + 456 = 579"
        stream = client.chat.completions.create(
            model="demo-llada",
            messages=[{"role": "user", "content": "What is 2 + 2?"}],
            temperature=0,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
            "2 + 2 = 4"
        )
        # The spawned ranks (multiprocessing's spawn_main), not its resource tracker.
        workers = [p for p in _children(server.process.pid)
                   if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        killed = time.monotonic()
        health, chat = _watch_the_failure(server, "demo-llada")
        exited = time.monotonic()
        # The first answer after the kill that is not 200 is a 503 (not a closed port), new
        # requests get 503 too, and then the process exits 1 within the grace and a margin.
        assert [s for s in health if s != 200][:1] == [503], health
        assert chat == 503
        assert server.process.returncode == 1
        assert exited - killed < FAILURE_GRACE_S + 8
        log = (tmp_path / "log").read_text()
        assert "tensor-parallel worker died: rank 1 (exit code -9)" in log
    finally:
        server.stop()


def _watch_the_failure(
    server: RemoteServer, model: str, bound_s: float = 20
) -> tuple[list[int | str], int | None]:
    """/health every 20 ms until the server exits: the statuses seen ("closed" once the
    port is gone), and the status of a chat request sent at the first 503 (None: none seen)."""
    health: list[int | str] = []
    chat = None
    deadline = time.monotonic() + bound_s
    with server.http() as http:
        while server.process.poll() is None and time.monotonic() < deadline:
            try:
                health.append(http.get("/health", timeout=10).status_code)
            except httpx.TransportError:
                health.append("closed")
            if health[-1] == 503 and chat is None:
                body = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
                chat = http.post("/v1/chat/completions", json=body, timeout=10).status_code
            time.sleep(0.02)
    server.process.wait(5)
    return health, chat


def _rank_env(rank: int, port: int) -> dict[str, str]:
    return {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip


def _start_rank1(model: str, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **_rank_env(1, port)}
    cmd = [sys.executable, "-m", "dllm_serve", "--model", model, "--tensor-parallel-size", "2"]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _start_ranks_apart(tmp_path: Path) -> tuple[subprocess.Popen, RemoteServer]:
    """Rank 1 and then rank 0 (the server) of tiny-llada, each its own `dllm-serve`."""
    port = free_port()
    rank1 = _start_rank1("tiny-llada", port, tmp_path / "rank1.log")
    server = RemoteServer.start(
        ["--tensor-parallel-size", "2", "--device", "cpu", "--log-level", "warning"],
        tmp_path / "rank0.log",
        env=_rank_env(0, port),
    )
    return rank1, server


# Slow (excluded by default; `pytest -m slow`): keeps the default suite near 10 minutes on 2 cores.
@pytest.mark.slow
def test_launcher_environment_joins_ranks_started_apart(tmp_path: Path) -> None:
    """torchrun-style: each rank is its own `dllm-serve` with WORLD_SIZE/RANK/MASTER_*; rank 0
    serves, rank 1 only runs forwards. A dead rank 1 fails rank 0 at its next step: 503,
    then exit status 1."""
    rank1, server = _start_ranks_apart(tmp_path)
    try:
        client = server.client()
        messages = [{"role": "user", "content": "Hello"}]
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
        with LLM("tiny-llada", device="cpu", dtype="float32") as llm:
            [want] = llm.generate([messages], DecodingParams(gen_length=8, steps=8))
        assert reply.choices[0].message.content == want.text
        rank1.kill()
        rank1.wait(10)
        with ThreadPoolExecutor(1) as pool:  # the request that meets the dead rank
            pending = pool.submit(
                client.chat.completions.create, model="m", messages=messages, max_tokens=8
            )
            health, chat = _watch_the_failure(server, "m")
            with pytest.raises((openai.APIError, openai.APIConnectionError)):
                pending.result(timeout=30)
        assert [s for s in health if s != 200][:1] == [503], health
        assert chat == 503
        assert server.process.returncode == 1
        assert "tensor-parallel collective failed" in (tmp_path / "rank0.log").read_text()
    finally:
        server.stop()
        if rank1.poll() is None:
            rank1.kill()


# Slow (excluded by default; `pytest -m slow`): keeps the default suite near 10 minutes on 2 cores.
@pytest.mark.slow
def test_an_idle_server_notices_a_launched_rank_that_died(tmp_path: Path) -> None:
    """No request is sent: the heartbeat alone (engine/parallel/group.py) finds the dead rank 1,
    which rank 0 cannot watch as a child, and fails rank 0 visibly: 503, then status 1."""
    rank1, server = _start_ranks_apart(tmp_path)
    try:
        rank1.kill()
        rank1.wait(10)
        killed = time.monotonic()
        health, chat = _watch_the_failure(server, "m", bound_s=STALE_S + FAILURE_GRACE_S + 15)
        assert [s for s in health if s != 200][:1] == [503], health
        assert chat == 503
        assert server.process.returncode == 1
        assert time.monotonic() - killed < STALE_S + FAILURE_GRACE_S + 10
        log = (tmp_path / "rank0.log").read_text()
        assert f"tensor-parallel heartbeat lost: rank 1 sent no heartbeat for {STALE_S:g} s" in log
    finally:
        server.stop()
        if rank1.poll() is None:
            rank1.kill()


# Slow (excluded by default; `pytest -m slow`): keeps the default suite near 10 minutes on 2 cores.
@pytest.mark.slow
def test_a_launched_rank_exits_when_rank_0_freezes(tmp_path: Path) -> None:
    """Rank 0 stopped (SIGSTOP: alive, silent, its sockets open): rank 1 would wait on its
    control channel forever; the heartbeat store stops answering and rank 1 exits with 1."""
    rank1, server = _start_ranks_apart(tmp_path)
    try:
        os.kill(server.process.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        assert rank1.wait(STORE_TIMEOUT_S + STALE_S + 15) == 1
        assert time.monotonic() - frozen < STORE_TIMEOUT_S + STALE_S + 10
        assert "tensor-parallel heartbeat lost:" in (tmp_path / "rank1.log").read_text()
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()
        if rank1.poll() is None:
            rank1.kill()


def test_ranks_with_different_checkpoints_are_refused(tmp_path: Path) -> None:
    port = free_port()
    other = write_tiny("llada", tmp_path / "other", seed=9)
    rank1 = _start_rank1(str(other), port, tmp_path / "rank1.log")
    with pytest.raises(RuntimeError, match="server exited with 1"):
        RemoteServer.start(
            ["--tensor-parallel-size", "2", "--device", "cpu"],
            tmp_path / "rank0.log",
            env=_rank_env(0, port),
            timeout=60,
        )
    assert rank1.wait(30) != 0
    for log in ("rank0.log", "rank1.log"):
        assert "ranks disagree on the checkpoint" in (tmp_path / log).read_text()


@pytest.mark.parametrize(("world", "flags"), [("4", ["--tensor-parallel-size", "2"]), ("2", [])])
def test_world_size_must_match_the_flag(tmp_path: Path, world: str, flags: list[str]) -> None:
    # Without the flag too (found by QA): each launched rank had served the whole model.
    size = flags[-1] if flags else "1"
    env = {**_rank_env(0, free_port()), "WORLD_SIZE": world}
    match = f"WORLD_SIZE={world} in the environment but --tensor-parallel-size {size}"
    with pytest.raises(RuntimeError, match=match):
        RemoteServer.start(flags, tmp_path / "log", env=env)


@pytest.mark.parametrize(("world", "device"), [(None, "cuda:1"), ("1", "cuda:1"), ("2", "cuda:3")])
def test_local_rank_is_the_launchers_only(
    monkeypatch: pytest.MonkeyPatch, world: str | None, device: str
) -> None:
    """Found by QA: workers the server spawns inherit its environment, so a LOCAL_RANK left by
    a pod spec put every one of them on the same GPU."""
    from dllm_serve.engine.parallel.rendezvous import device_for

    monkeypatch.setenv("LOCAL_RANK", "3")
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    assert device_for("cuda", 1) == device


@pytest.mark.parametrize(
    ("env", "message"),
    [({"RANK": "5"}, "RANK=5 in the environment: it must be 0 to 1"),
     ({"RANK": "-1"}, "RANK=-1 in the environment: it must be 0 to 1"),
     ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment is not an integer"),
     ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' in the environment is not an integer"),
     ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port")],
)  # fmt: skip
def test_a_launcher_environment_out_of_range_is_refused(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    """Found by QA: RANK=5 of 2 hung silently; WORLD_SIZE=abc was a traceback (the server
    prints this error as one line: serving.py catches ModelLoadError)."""
    from dllm_serve.engine.parallel.rendezvous import multi_node_rank

    for key, value in {**_rank_env(0, 1), **env}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ModelLoadError, match=message):
        multi_node_rank(2)


def test_a_worker_that_dies_before_joining_fails_rank_0_at_once(tmp_path: Path) -> None:
    """Found by QA: rank 0 waited ten minutes, silently, for a worker that had died before it
    joined the group; the usual way there is an offline script without a __main__ guard (the
    spawned worker re-runs the script and cannot start processes while bootstrapping)."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from dllm_serve.llm import LLM\nLLM('tiny-llada', device='cpu', tensor_parallel_size=2)\n"
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert time.monotonic() - started < 120
    assert "tensor-parallel worker died while the group was starting: rank 1" in done.stderr
    assert 'needs `if __name__ == "__main__":`' in done.stderr


# Slow (excluded by default; `pytest -m slow`): keeps the default suite near 10 minutes on 2 cores.
@pytest.mark.slow
def test_a_frozen_worker_does_not_outlive_the_server(tmp_path: Path) -> None:
    """Found by QA: rank 0 exited 1 as documented, but a SIGSTOPped worker stayed behind,
    adopted by init (on a GPU, still holding its memory)."""
    server = RemoteServer.start(
        ["--model", "tiny-llada", "--tensor-parallel-size", "2", "--log-format", "json"],
        tmp_path / "log",
    )
    worker = None
    try:
        workers = [p for p in _children(server.process.pid)
                   if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
        assert len(workers) == 1
        worker = workers[0]
        os.kill(worker, signal.SIGSTOP)
        assert server.process.wait(STALE_S + STORE_TIMEOUT_S + FAILURE_GRACE_S + 20) == 1
        deadline = time.monotonic() + 10
        while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        # Gone, or at most a zombie until init reaps it: never a stopped process left running.
        state = (
            Path(f"/proc/{worker}/stat").read_text().split()[2]
            if Path(f"/proc/{worker}").exists()
            else "gone"
        )
        assert state in ("gone", "Z"), state
        log = (tmp_path / "log").read_text()
        assert "tensor-parallel heartbeat lost" in log
    finally:
        if worker is not None and Path(f"/proc/{worker}").exists():
            os.kill(worker, signal.SIGKILL)
        server.stop()


# Slow (excluded by default; `pytest -m slow`): keeps the default suite near 10 minutes on 2 cores.
@pytest.mark.slow
def test_a_refused_engine_stops_its_workers(tmp_path: Path) -> None:
    """Found by QA: a config the engine refused left the workers and the process group up, so
    every later LLM(tensor_parallel_size=2) in the process failed ("initialize the default
    process group twice"); the server's refusal was followed by a false "worker died"."""
    from dllm_serve.config import EngineConfig

    with pytest.raises(ValueError, match=r"--decoding-mode ar: model 'tiny-llada' decodes only"):
        LLM("tiny-llada", device="cpu", tensor_parallel_size=2,
            engine_config=EngineConfig(decoding_mode="ar"))  # fmt: skip
    with LLM("tiny-llada", device="cpu", tensor_parallel_size=2) as llm:
        assert llm.generate([[{"role": "user", "content": "Hi"}]], DecodingParams(gen_length=4))
    log = tmp_path / "refused.log"  # the false report came about half the time
    with pytest.raises(RuntimeError, match="server exited with 1"):
        RemoteServer.start(
            ["--model", "tiny-llada", "--tensor-parallel-size", "2", "--isd-stride", "8"], log
        )
    text = log.read_text()
    assert "--isd-stride" in text and "worker died" not in text, text[-2000:]

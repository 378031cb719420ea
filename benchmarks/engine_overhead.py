"""Engine overhead: engine throughput / throughput of a bare loop of the very same forwards.

    python benchmarks/engine_overhead.py                    # tiny-llada on CPU
    python benchmarks/engine_overhead.py --requests 64 --gen-length 64 --repeat 5
    python benchmarks/engine_overhead.py --model /models/LLaDA-8B-Instruct --device cuda
    python benchmarks/engine_overhead.py --random-8b --device cuda   # LLaDA-8B-shaped, bf16

``--random-8b`` serves random bf16 weights of LLaDA-8B's shape (no checkpoint needed; the
tiny-llada tokenizer and special ids, which the 8B vocabulary contains; random logits never pick
EOS, so every answer is the whole canvas). ``--random-llada2-mini`` does the same for
LLaDA2.0-mini's shape (block-diffusion MoE: 20 layers, 256 experts, top-8; about 16B
parameters, 32 GB in bf16), with a tiny LLaDA2 checkpoint's tokenizer and special ids; its
experts are stacked on the device for the grouped GEMMs, as the loader does. With random
weights the schedule alone decides how many tokens a forward commits (``--steps`` per
``--block-length``). With ``--tiny`` either is the same architecture at toy size, for a CPU
smoke run.

One run = ``--requests`` chats (templated and tokenised beforehand) submitted at once through
the offline :class:`LLM` (the same ``AsyncEngine`` the server uses: scheduler, ModelRunner,
batched sampler, detokenisation, output queues). While it runs, the ModelRunner's ``forward``
is wrapped so that every ``FlatBatch`` it fed to the model is recorded. Those batches are then
replayed through the same ``forward`` in a plain loop, with no engine around: same model, same
tokens, same logit positions. The ratio

    engine throughput / bare throughput  ==  bare-loop seconds / engine seconds

(the same forwards, so the same work) says how close the engine gets to the model's own limit;
1 − ratio is the share of wall time spent outside the model (building batches, sampling and
committing tokens, the device→host copy, detokenising, thread hand-offs). Engine and bare loop
alternate ``--repeat`` times in one process, so background load hits both alike; the pair with
the median ratio is reported (and every pair).

Each pair also runs the **plain loop**: the same prompts decoded by the same algorithm's steps
(``init_state``, then prepare → ``ModelRunner.run`` → batched sample → one device→host copy →
commit, until every row finishes) in a bare Python loop, with no engine around it: no thread,
queue, scheduler, outputs or detokenising. ``bare / plain`` is the ratio an engine with zero
overhead of its own would reach, since the algorithm's own host work (above all the sampler's
confidence softmax) is still there; ``plain / engine`` is what the engine itself costs on top.

With ``--kv-cache prefix`` the replayed batches read and write the same KV-pool slots as in the
run (the pool is idle by then, so the values differ but the work is the same). Writes
``benchmarks/results/engine_overhead.json`` (+ ``.png`` with matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    PROMPTS,
    RESULTS_DIR,
    add_threads_option,
    apply_threads,
    at_least,
    machine_info,
    plot_if_available,
    write_json,
)
from gpu_llada8b import DEFAULT_CONFIG, build_model, materialise_random, tiny_config

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.graphs import StaticForward
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.engine.scheduler import Scheduler
from dllm_serve.llm import LLM
from dllm_serve.models.attention import FlatBatch
from dllm_serve.models.families.llada import LLADA
from dllm_serve.models.families.llada2 import LLADA2
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve.models.moe import MoE
from dllm_serve.models.transformer import DecoderTransformer, TransformerConfig
from dllm_serve_train.tiny_checkpoints import write_tiny

LLADA2_MINI = DEFAULT_CONFIG.parents[1] / "llada2-mini" / "config.json"


def sync(device: torch.device) -> None:
    """Wait for queued kernels: wall times on CUDA are meaningless without it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# One recorded forward: an eager batch, or a graph replay (its static forward).
Recorded = FlatBatch | StaticForward


# The host phases of a step that lie on its critical path: the next forward needs them done.
CHAIN_PHASES = ("prepare", "build", "sample", "commit")


def timed(phases: dict[str, float], name: str, method: Any) -> Any:
    """``method`` with its wall time added to ``phases[name]`` (two clock reads a call)."""

    def wrapper(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args)
        finally:
            phases[name] += time.perf_counter() - started

    return wrapper


def engine_run(
    llm: LLM, prompts: list[list[int]], params: DecodingParams
) -> tuple[float, list[Recorded], int, float, dict[str, float]]:
    """Generate all (templated, tokenised) prompts at once; returns (seconds, recorded
    forwards, answer tokens, seconds spent inside those forwards — on CPU, where a forward is
    synchronous — and the seconds of each host phase of :data:`CHAIN_PHASES`)."""
    recorded: list[Recorded] = []
    inside = [0.0]
    engine = llm.engine
    runner, algorithm = engine.runner, engine.algorithm
    original, original_graph = runner.forward, runner.forward_graph
    phases = dict.fromkeys(CHAIN_PHASES, 0.0)
    # Instance attributes shadow the methods for this run only (deleted below); each is
    # called once per forward, so the timers cost a few clock reads a step.
    runner.build = timed(phases, "build", runner.build)  # type: ignore[method-assign]
    packer = runner.packer
    packer.fill = timed(phases, "build", packer.fill)  # type: ignore[method-assign]
    algorithm.sample = timed(phases, "sample", algorithm.sample)  # type: ignore[method-assign]
    engine._prepare = timed(phases, "prepare", engine._prepare)  # type: ignore[method-assign]
    engine._commit = timed(phases, "commit", engine._commit)  # type: ignore[method-assign]

    def recording_forward(batch: FlatBatch) -> torch.Tensor:
        recorded.append(batch)  # a list append: negligible next to a forward
        started = time.perf_counter()
        logits = original(batch)
        inside[0] += time.perf_counter() - started
        return logits

    def recording_graph(static: StaticForward) -> torch.Tensor:
        recorded.append(static)
        started = time.perf_counter()
        logits = original_graph(static)
        inside[0] += time.perf_counter() - started
        return logits

    runner.forward = recording_forward  # type: ignore[method-assign]
    runner.forward_graph = recording_graph  # type: ignore[method-assign]
    try:
        sync(llm.loaded.device)
        start = time.perf_counter()
        outs = llm.generate_ids(prompts, [params] * len(prompts))
        sync(llm.loaded.device)
        seconds = time.perf_counter() - start
    finally:
        del runner.forward, runner.forward_graph, runner.build  # back to the class's methods
        del packer.fill
        del algorithm.sample, engine._prepare, engine._commit
    return seconds, recorded, sum(o.completion_tokens for o in outs), inside[0], phases


def bare_run(runner: ModelRunner, batches: list[Recorded], device: torch.device) -> float:
    """The same forwards in a plain loop (logits at the requested positions, as the engine;
    a graphed step replays its graph over the static inputs its last step left)."""
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            if isinstance(batch, FlatBatch):
                runner.forward(batch)
            else:
                runner.forward_graph(batch)
    sync(device)
    return time.perf_counter() - start


@dataclasses.dataclass(slots=True, eq=False)  # rows are removed by identity, as requests
class _PlainRow:
    """What the engine's scheduler reads of a running request, for the plain loop's rows."""

    state: Any
    params: DecodingParams

    @property
    def row_length(self) -> int:
        return self.state.row_length

    @property
    def is_prefill(self) -> bool:
        return self.state.is_prefill


def plain_run(
    llm: LLM, prompts: list[list[int]], params: DecodingParams
) -> tuple[float, int, float]:
    """The algorithm's steps for ``prompts`` in a plain loop (no engine): (seconds, forwards,
    seconds inside the forwards and the sampler — the loop with its bookkeeping free).

    The engine's :class:`Scheduler` groups and orders each iteration's rows, at most
    ``max_running_requests`` run at once and a finished row's place goes to the next prompt
    before the next iteration, as in the engine, so the loop runs the engine's forwards."""
    engine = llm.engine
    runner, algorithm, device = engine.runner, engine.algorithm, llm.loaded.device
    scheduler = Scheduler(engine.config)
    forwards, model_and_sampler = 0, 0.0
    waiting = list(reversed(prompts))
    with torch.inference_mode():
        sync(device)
        start = time.perf_counter()
        while waiting or scheduler.running:
            while waiting and len(scheduler.running) < engine.config.max_running_requests:
                prompt = waiting.pop()
                state = algorithm.init_state(prompt, params, device)
                need = engine.kv.need(len(prompt), params)
                if need:
                    assert runner.pool is not None
                    state.kv = runner.pool.reserve(need)
                    assert state.kv is not None, "the pool holds every running request"
                scheduler.running.append(_PlainRow(state, params))  # type: ignore[arg-type]
            for group in scheduler.groups():
                states = [row.state for row in group]
                specs = [algorithm.prepare(s) for s in states]
                if runner.graphs is None:  # eager: pack the batch outside the timed part
                    batch, _ = runner.build(specs)
                    started = time.perf_counter()
                    logits = runner.step_logits(batch, runner.forward(batch))
                else:  # graph replays fill their static inputs inside run()
                    started = time.perf_counter()
                    logits = runner.run(specs)
                host = algorithm.sample(states, logits).tolist()
                model_and_sampler += time.perf_counter() - started
                del logits
                forwards += 1
                for row, result in zip(group, algorithm.commit(states, host), strict=True):
                    if result.finished:
                        if row.state.kv is not None:
                            runner.pool.free(row.state.kv)  # type: ignore[union-attr]
                            row.state.kv = None
                        scheduler.running.remove(row)  # type: ignore[arg-type]
        sync(device)
        seconds = time.perf_counter() - start
    return seconds, forwards, model_and_sampler


def real_tokens(batch: Recorded) -> tuple[int, int]:
    """(rows, real tokens) of one recorded forward."""
    if isinstance(batch, FlatBatch):
        return sum(g.rows for g in batch.groups), batch.num_tokens
    static, rows, _width = batch
    return rows, rows * static.key.q_len


def _median(values: list[float | None]) -> float | None:
    """The lower median of the values that exist (None on CUDA, where they are not measured)."""
    known = sorted(v for v in values if v is not None)
    return round(known[(len(known) - 1) // 2], 4) if known else None


def _rounded(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 4) if isinstance(value, float) else value


def open_llm(args: argparse.Namespace, config: EngineConfig) -> LLM:
    """The LLM to measure: a loaded checkpoint, or random weights of LLaDA-8B's or
    LLaDA2.0-mini's shape."""
    if args.random_llada2_mini:
        return LLM.from_loaded(random_llada2_mini(args), config)
    if not args.random_8b:
        return LLM(args.model, device=args.device, dtype=args.dtype, engine_config=config)
    base = load_model("tiny-llada", device=args.device, dtype="float32")
    shape = LLADA.transformer_config(json.loads(DEFAULT_CONFIG.read_text()))
    if args.tiny:  # toy size, but every id of the tokenizer still embeds
        shape = dataclasses.replace(tiny_config(shape), vocab_size=base.model.config.vocab_size)
    dtype = torch.bfloat16 if base.device.type == "cuda" else torch.float32
    model = build_model(shape, base.device, dtype)
    args.model = "random-llada-8b" + ("-tiny" if args.tiny else "")
    loaded = dataclasses.replace(
        base, name=args.model, model=model, dtype=dtype, max_length=shape.max_sequence_length
    )
    return LLM.from_loaded(loaded, config)


def random_llada2_mini(args: argparse.Namespace) -> LoadedModel:
    """A tiny LLaDA2 checkpoint (its tokenizer, special ids and block size) carrying random
    weights of LLaDA2.0-mini's shape (toy size with ``--tiny``)."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        base = load_model(str(write_tiny("llada2", Path(root) / "llada2")), device=args.device,
                          dtype="float32")  # fmt: skip
    shape = LLADA2.transformer_config(json.loads(LLADA2_MINI.read_text()))
    if args.tiny:
        assert shape.moe is not None
        moe = dataclasses.replace(shape.moe, num_experts=16, n_group=4, topk_group=2, top_k=4,
                                  expert_hidden_size=32, shared_hidden_size=32)  # fmt: skip
        shape = dataclasses.replace(tiny_config(shape), moe=moe,
                                    vocab_size=base.model.config.vocab_size)  # fmt: skip
    dtype = torch.bfloat16 if base.device.type == "cuda" else torch.float32
    model = build_moe_model(shape, base.device, dtype)
    args.model = "random-llada2-mini" + ("-tiny" if args.tiny else "")
    return dataclasses.replace(
        base, name=args.model, model=model, dtype=dtype, max_length=shape.max_sequence_length
    )


def build_moe_model(
    cfg: TransformerConfig, device: torch.device, dtype: torch.dtype
) -> DecoderTransformer:
    """Meta → random ``dtype`` weights on ``device`` → fused, experts stacked there (the
    grouped GEMMs are checked on the device and dtype they run in, so this fuses after
    materialising, unlike ``build_model``); routers in fp32, as the loader keeps them."""
    with torch.device("meta"):
        model = DecoderTransformer(cfg)
    model = materialise_random(model, device, dtype)
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.router.float()
    return model.fuse_projections()


def draw(report: dict[str, Any]) -> Any:
    """Bar chart: engine vs bare-loop forwards/s, ratio in the title."""

    def _draw(plt: Any) -> None:
        _fig, ax = plt.subplots(figsize=(5, 4))
        e, b = report["engine"], report["bare_loop"]
        ax.bar(["engine", "bare loop"], [e["forwards_per_s"], b["forwards_per_s"]])
        ax.set(ylabel="forwards/s", title=f"engine / bare = {report['ratio']:.2f}")

    return _draw


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llada")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=at_least(1), default=16, help="submitted at once")
    parser.add_argument("--gen-length", type=at_least(1), default=32)
    parser.add_argument("--steps", type=at_least(1), default=32)
    parser.add_argument("--block-length", type=at_least(1), default=None)
    parser.add_argument("--max-running-requests", type=at_least(1), default=32)
    parser.add_argument("--kv-cache", default="none", choices=["none", "prefix"])
    parser.add_argument(
        "--no-cuda-graph", action="store_true", help="on CUDA: every step eager (no graphs)"
    )
    parser.add_argument(
        "--cuda-graph-max-tokens",
        type=at_least(16),
        default=EngineConfig().cuda_graph_max_tokens,
        help="on CUDA: the largest graphed forward (fewer graphs to capture at start-up)",
    )
    parser.add_argument(
        "--random-8b", action="store_true", help="random bf16 weights of LLaDA-8B's shape"
    )
    parser.add_argument(
        "--random-llada2-mini",
        action="store_true",
        help="random bf16 weights of LLaDA2.0-mini's shape (MoE block diffusion)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="with --random-8b or --random-llada2-mini: toy size"
    )
    parser.add_argument(
        "--repeat", type=at_least(1), default=3, help="engine/bare pairs; median reported"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "engine_overhead.json")
    add_threads_option(parser)
    args = parser.parse_args(argv)
    if args.tiny and not (args.random_8b or args.random_llada2_mini):
        parser.error("--tiny shrinks a --random-* model: pass one")
    if args.random_8b and args.random_llada2_mini:
        parser.error("--random-8b and --random-llada2-mini: pick one")
    apply_threads(args.threads)

    config = EngineConfig(
        max_running_requests=args.max_running_requests,
        max_waiting_requests=1 << 30,
        kv_cache=args.kv_cache,
        cuda_graph=not args.no_cuda_graph,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
    )
    params = DecodingParams(
        gen_length=args.gen_length, steps=args.steps, block_length=args.block_length
    )
    conversations = [
        [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(args.requests)
    ]
    pairs = []
    with open_llm(args, config) as llm:
        device = llm.loaded.device
        llm.generate(conversations[:1], DecodingParams(gen_length=8, steps=8))  # warm-up
        # Chat templating is API work (the server does it in worker threads, off the engine):
        # prompts are tokenised once, before any timer, so the ratio is the engine's alone.
        prompts = [llm.engine.chat_prompt_ids(c) for c in conversations]
        for _ in range(args.repeat):
            seconds, batches, answer, inside, phases = engine_run(llm, prompts, params)
            bare = bare_run(llm.engine.runner, batches, device)
            plain, plain_forwards, model_and_sampler = plain_run(llm, prompts, params)
            cpu = device.type == "cpu"
            pairs.append(
                {
                    "engine_s": seconds,
                    "bare_s": bare,
                    "forwards": len(batches),
                    "rows": sum(real_tokens(b)[0] for b in batches),
                    "tokens": sum(real_tokens(b)[1] for b in batches),
                    "graph_replays": sum(not isinstance(b, FlatBatch) for b in batches),
                    "answer_tokens": answer,
                    "ratio": bare / seconds,
                    "plain_s": plain,
                    "plain_forwards": plain_forwards,
                    # The engine with zero overhead of its own; and the engine against that.
                    "plain_ratio": bare / plain,
                    "engine_vs_plain": plain / seconds,
                    # The plain loop with every step's bookkeeping free (prepare, batch
                    # packing, commit): only its forwards and the batched sampler with its one
                    # device→host copy count. The ratio no loop of this algorithm can pass
                    # while its sampler does the same arithmetic.
                    "sampler_ceiling": bare / model_and_sampler,
                    # The forwards' share of the engine's own wall time: the same window, so
                    # unlike the ratio it does not move with the load between the two runs
                    # (but it hides any slowdown the engine's host work causes the forward).
                    "model_share": inside / seconds if cpu else None,
                    # Per forward, ms: each host phase on the step's critical path (on CUDA
                    # they include waiting for queued kernels, so only CPU reports them).
                    "phase_ms": {k: 1e3 * v / len(batches) for k, v in phases.items()}
                    if cpu
                    else None,
                    # The ratio the engine would reach if all its other host work (outputs,
                    # scheduling, hand-offs) cost nothing: forward / (forward + those phases).
                    "chain_ceiling": inside / (inside + sum(phases.values())) if cpu else None,
                }
            )
            del batches
        model_name = llm.loaded.name

    # Each pair replays its own engine run's batches (admission timing can group rows a little
    # differently from run to run), so a ratio is only meaningful within a pair: report the
    # pair with the median ratio, its absolute numbers, and every pair.
    pairs.sort(key=lambda p: p["ratio"])
    mid = pairs[(len(pairs) - 1) // 2]

    def rates(seconds: float, pair: dict[str, Any]) -> dict[str, Any]:
        return {
            "seconds": round(seconds, 4),
            "forwards_per_s": round(pair["forwards"] / seconds, 2),
            "rows_per_s": round(pair["rows"] / seconds, 2),
            "tokens_per_s": round(pair["tokens"] / seconds, 1),
            # Answer tokens per second the bare loop would give: the same forwards make them.
            "answer_tokens_per_s": round(pair["answer_tokens"] / seconds, 2),
        }

    report = {
        "benchmark": "engine_overhead",
        "model": model_name,
        "random_weights": args.model.startswith(("tiny-", "random-")),
        "device": str(device),
        "requests": args.requests,
        "gen_length": args.gen_length,
        "steps": args.steps,
        "block_length": args.block_length,
        "kv_cache": args.kv_cache,
        "cuda_graph": config.cuda_graph and str(device).startswith("cuda"),
        "cuda_graph_max_tokens": config.cuda_graph_max_tokens,
        "repeat": args.repeat,
        "forwards": mid["forwards"],
        "graph_replays": mid["graph_replays"],
        "mean_rows_per_forward": round(mid["rows"] / mid["forwards"], 3),
        "engine": rates(mid["engine_s"], mid),
        "bare_loop": rates(mid["bare_s"], mid),
        "ratio": round(mid["ratio"], 4),
        "ratio_min_max": [round(pairs[0]["ratio"], 4), round(pairs[-1]["ratio"], 4)],
        # Medians over the pairs (each its own pair's figure, like the ratio).
        "plain_ratio_median": _median([p["plain_ratio"] for p in pairs]),
        "engine_vs_plain_median": _median([p["engine_vs_plain"] for p in pairs]),
        "sampler_ceiling_median": _median([p["sampler_ceiling"] for p in pairs]),
        # CPU only (a CUDA forward returns before its kernels finish): median over the pairs.
        "model_share_median": _median([p["model_share"] for p in pairs]),
        "chain_ceiling_median": _median([p["chain_ceiling"] for p in pairs]),
        "phase_ms_median": {
            name: _median([p["phase_ms"][name] for p in pairs if p["phase_ms"]])
            for name in CHAIN_PHASES
        },
        "pairs": [_rounded(p) for p in pairs],
        "machine": machine_info(),
    }
    print(
        f"{report['forwards']} forwards, {report['mean_rows_per_forward']} rows/forward: engine "
        f"{report['engine']['forwards_per_s']} fwd/s ({report['engine']['answer_tokens_per_s']} "
        f"answer tok/s), bare {report['bare_loop']['forwards_per_s']} fwd/s → ratio "
        f"{report['ratio']} (pairs: {report['ratio_min_max']}); plain loop (no engine) / bare "
        f"{report['plain_ratio_median']}, engine / plain loop {report['engine_vs_plain_median']}"
        f", forwards + sampler alone {report['sampler_ceiling_median']}; model share of engine "
        f"time {report['model_share_median']}, critical-path ceiling "
        f"{report['chain_ceiling_median']}"
        f" (host ms per forward: {report['phase_ms_median']})"
    )
    write_json(args.out, report)
    plot_if_available(args.out.with_suffix(".png"), draw(report))
    return report


if __name__ == "__main__":
    main()

"""Each benchmark script runs end to end on a tiny setting and writes JSON with its keys.

Benchmarks are not tests: nothing here asserts a timing, only that the scripts work and that
their reports have the shape docs/benchmarks.md describes.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dllm_serve_train.phrasings import REVERSAL

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


def load(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` (a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _restore_threads() -> object:
    """``--threads 1`` sets torch's global thread count: give the next tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def read(path: Path) -> dict:
    return json.loads(path.read_text())


# Slow (excluded by default; `pytest -m slow`): keeps the default suite near 10 minutes on 2 cores.
@pytest.mark.slow
def test_serving_load_sweep(tmp_path: Path) -> None:
    out = tmp_path / "serving_load.json"
    load("serving_load").main(
        ["--concurrency", "1", "2", "--requests-per-level", "3", "--max-tokens", "8",
         "--steps", "4", "--server-threads", "1", "--out", str(out)]
    )  # fmt: skip
    report = read(out)
    assert report["model"] == "demo-llada"
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert level["requests_ok"] == 3, level["errors"]
        assert level["answer_tokens"] >= 0
        for key in ("answer_tokens_per_s", "wall_s", "forwards", "mean_rows_per_forward"):
            assert key in level
        assert set(level["ttfc_ms"]) == set(level["e2e_ms"]) == {"p50", "p99"}
        assert level["forwards"] > 0 and level["mean_rows_per_forward"] >= 1


def test_serving_load_refuses_non_loopback(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        load("serving_load").main(["--url", "http://example.com:8000", "--out", str(tmp_path)])


def test_engine_overhead(tmp_path: Path) -> None:
    out = tmp_path / "engine_overhead.json"
    load("engine_overhead").main(
        ["--requests", "3", "--gen-length", "8", "--steps", "4", "--repeat", "2", "--threads", "1",
         "--out", str(out)]
    )  # fmt: skip
    report = read(out)
    assert report["forwards"] > 0
    for side in ("engine", "bare_loop"):
        for key in ("seconds", "forwards_per_s", "answer_tokens_per_s", "rows_per_s"):
            assert key in report[side]
    assert report["ratio"] > 0 and len(report["pairs"]) == 2
    assert all(p["forwards"] > 0 and p["bare_s"] > 0 for p in report["pairs"])
    # The forwards run inside the engine's window: a share, strictly between 0 and 1.
    assert all(0 < p["model_share"] < 1 for p in report["pairs"])
    assert report["model_share_median"] in [p["model_share"] for p in report["pairs"]]
    for p in report["pairs"]:
        # Every critical-path phase ran, and they are disjoint from the forwards inside the
        # engine's window: the ceiling lies between the model share and 1.
        assert set(p["phase_ms"]) == {"prepare", "build", "sample", "commit"}
        assert all(ms > 0 for ms in p["phase_ms"].values()), p["phase_ms"]
        assert p["model_share"] <= p["chain_ceiling"] < 1
    assert report["chain_ceiling_median"] in [p["chain_ceiling"] for p in report["pairs"]]
    for p in report["pairs"]:
        # The plain loop decodes the same prompts by the same steps: greedy, so the very same
        # forwards as the engine's; its model-and-sampler time is a part of its wall time.
        assert p["plain_forwards"] == p["forwards"]
        # (the report rounds seconds to 0.1 ms, hence the tolerance)
        assert p["plain_s"] > 0
        assert p["plain_ratio"] == pytest.approx(p["bare_s"] / p["plain_s"], rel=0.1)
        assert p["engine_vs_plain"] == pytest.approx(p["plain_s"] / p["engine_s"], rel=0.1)
        assert p["sampler_ceiling"] > p["plain_ratio"]
    for name in ("plain_ratio", "engine_vs_plain", "sampler_ceiling"):
        assert report[f"{name}_median"] in [round(p[name], 4) for p in report["pairs"]]


def test_engine_overhead_random_8b_shape_tiny(tmp_path: Path) -> None:
    out = tmp_path / "engine_overhead_random.json"
    load("engine_overhead").main(
        ["--random-8b", "--tiny", "--requests", "2", "--gen-length", "8", "--steps", "4",
         "--repeat", "1", "--threads", "1", "--out", str(out)]
    )  # fmt: skip
    report = read(out)
    assert report["model"] == "random-llada-8b-tiny" and report["random_weights"]
    assert report["forwards"] > 0 and report["engine"]["answer_tokens_per_s"] > 0


def test_engine_overhead_random_llada2_mini_shape_tiny(tmp_path: Path) -> None:
    """LLaDA2.0-mini's architecture at toy size: MoE layers with their experts stacked for
    the grouped GEMMs, served by the block-diffusion decoder."""
    out = tmp_path / "engine_overhead_mini.json"
    load("engine_overhead").main(
        ["--random-llada2-mini", "--tiny", "--requests", "2", "--gen-length", "32", "--steps",
         "8", "--repeat", "1", "--threads", "1", "--out", str(out)]
    )  # fmt: skip
    report = read(out)
    assert report["model"] == "random-llada2-mini-tiny" and report["random_weights"]
    assert report["engine"]["answer_tokens_per_s"] > 0
    assert report["forwards"] > 0
    with pytest.raises(SystemExit):
        load("engine_overhead").main(["--random-8b", "--random-llada2-mini", "--tiny"])


def test_constrained(tmp_path: Path) -> None:
    out = tmp_path / "constrained.json"
    load("constrained").main(["--prompts", "1", "--threads", "1", "--out", str(out)])
    report = read(out)
    demo, tiny, idlm = report["models"]
    assert (demo["model"], tiny["family"], idlm["model"]) == ("demo-llada", "llada2", "demo-idlm")
    for model, count in ((demo, 6), (tiny, 6), (idlm, 2)):
        variants = {(r["rule"], r["variant"]) for r in model["rows"]}
        assert len(variants) == count
        for row in model["rows"]:
            assert row["nfe"] > 0 and row["ms_per_forward"] > 0
            if row["variant"] == "constrained":  # enforced: every answer parses
                assert row["valid_json"] == row["stopped"] == row["requests"]


def test_block_diffusion(tmp_path: Path) -> None:
    out = tmp_path / "block_diffusion.json"
    load("block_diffusion").main(
        ["--prompts", "2", "--max-tokens", "8", "--threads", "1", "--out", str(out)]
    )
    report = read(out)
    assert report["random_weights"]
    sdar, llada2, fast = report["models"]
    assert (sdar["family"], sdar["block_size"]) == ("sdar_block", 4)
    assert (llada2["family"], llada2["block_size"]) == ("llada2", 32)
    by2 = {(r["setting"], r["fused_write"]): r for r in llada2["rows"]}
    for setting in {s for s, _ in by2}:  # the same answers whether the write is fused or not
        assert by2[setting, True]["answer_tokens"] == by2[setting, False]["answer_tokens"] > 0
    by = {(r["setting"], r["fused_write"]): r for r in sdar["rows"]}
    for setting in {s for s, _ in by}:
        fused, unfused = by[setting, True], by[setting, False]
        assert fused["answer_tokens"] == unfused["answer_tokens"] > 0
        assert fused["nfe"] < unfused["nfe"]  # the fused write saves a forward per block
    # Fast-dLLM v2: block 32 in sub-blocks of 8, its write never fused.
    assert (fast["family"], fast["block_size"], fast["sub_block"]) == ("fastdllm", 32, 8)
    assert {r["fused_write"] for r in fast["rows"]} == {False} and len(fast["rows"]) == 4
    assert all(r["answer_tokens"] > 0 and r["nfe"] > 0 for r in fast["rows"])


def test_graph_coverage(tmp_path: Path) -> None:
    """Staggered sampled SDAR traffic through the static forwards on CPU: decode forwards are
    counted among all forwards, and the graphed ones among them."""
    out = tmp_path / "graph_coverage.json"
    load("graph_coverage").main(["--requests", "3", "--only", "sdar blocks", "--out", str(out)])
    report = read(out)
    assert report["captured"] is False and report["requests"] == 3
    sdar = report["modes"]["sdar blocks"]
    assert sdar["all_forwards"] > sdar["forwards"] >= sdar["graphable"] > 0
    assert sdar["all_graphable"] >= sdar["graphable"]
    assert sdar["max_rows_per_forward"] >= 2 and sdar["captures_failed"] == 0
    with pytest.raises(SystemExit):
        load("graph_coverage").main(["--only", "no such mode", "--out", str(out)])


def test_gpu_llada8b_tiny_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "gpu.json"
    # No matplotlib: JSON still written, no PNG.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    load("gpu_llada8b").main(
        ["--allow-cpu", "--tiny", "--device", "cpu", "--prefix", "16", "--block", "8",
         "--batches", "1", "2", "--warmup", "1", "--iters", "2", "--threads", "1",
         "--out", str(out)]
    )  # fmt: skip
    report = read(out)
    assert report["tiny"] and report["weight_bytes"] > 0
    assert [r["batch"] for r in report["results"]] == [1, 2]
    assert report["kv_pool_slots"] == 2 * 32  # prefix + block (24) in whole pages, batch 2
    for row in report["results"]:
        for mode in ("no_cache", "prefix_refresh", "prefix_cache"):
            assert {"latency_ms_median", "block_positions_per_s", "run_ms_median"} <= set(row[mode])
        assert row["prefix_cache"]["tokens_fed_per_row"] == 8
        assert row["prefix_refresh"]["flat_tokens"] == row["batch"] * (16 + 8)
        per_slot = report["kv_pool_bytes"] // report["kv_pool_slots"]
        assert row["kv_pool_used_bytes"] == row["batch"] * 32 * per_slot  # two pages a row
        assert row["cached_vs_refresh_max_abs_logit_diff"] < 1e-4
    assert not out.with_suffix(".png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the no-GPU path")
def test_gpu_llada8b_refuses_without_gpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert load("gpu_llada8b").main(["--out", str(out)]) is None
    assert load("gpu_llada8b").main(["--device", "cpu", "--out", str(out)]) is None
    assert not out.exists()


def test_gpu_profile_step_tiny_smoke(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    load("gpu_profile_step").main(
        ["--allow-cpu", "--tiny", "--device", "cpu", "--prefix", "16", "--block", "8",
         "--batches", "1", "2", "--calls", "2", "--top", "3", "--out", str(out)]
    )  # fmt: skip
    report = read(out)
    assert report["tiny"] and report["device"] == "cpu"
    assert [r["batch"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        for case in ("eager", "run"):
            profiled = row[case]
            assert profiled["kernels_per_call"] > 0 and profiled["kernel_ms_per_call"] > 0
            assert 0 < len(profiled["top"]) <= 3
            shares = [t["share"] for t in profiled["top"]]
            assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1.0001


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the no-GPU path")
def test_gpu_profile_step_refuses_without_gpu(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    assert load("gpu_profile_step").main(["--out", str(out)]) is None
    assert not out.exists()


def test_gpu_moe_layer_tiny_smoke(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    load("gpu_moe_layer").main(
        ["--allow-cpu", "--tiny", "--device", "cpu", "--tokens", "8", "64", "--warmup", "1",
         "--iters", "2", "--threads", "1", "--out", str(out)]
    )  # fmt: skip
    report = read(out)
    assert report["tiny"] and report["dtype"] == "float32" and report["top_k"] == 4
    assert [r["tokens"] for r in report["results"]] == [8, 64]
    for row in report["results"]:
        assert not row["grouped_refused"] and row["grouped_ms"] > 0 and row["one_by_one_ms"] > 0
        assert row["relative_difference"] == 0.0  # one CPU thread: bitwise the same


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the no-GPU path")
def test_gpu_moe_layer_refuses_without_gpu(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    assert load("gpu_moe_layer").main(["--out", str(out)]) is None
    assert not out.exists()


# Slow (excluded by default; `pytest -m slow`): keeps the default suite near 10 minutes on 2 cores.
@pytest.mark.slow
def test_demo_ablation(tmp_path: Path) -> None:
    out = tmp_path / "demo_ablation.json"
    bench = load("demo_ablation")
    bench.main(["--n-addition", "2", "--n-other", "1", "--threads", "1", "--out", str(out)])
    report = read(out)
    assert report["llada_model"] == "demo-llada" and report["idlm_model"] == "demo-idlm"
    llada = {(r["setting"], r["kv_cache"]) for r in report["llada"]}
    assert llada == {(s, "none") for s in bench.LLADA_SETTINGS} | {
        (s, "prefix") for s in bench.WITH_PREFIX_CACHE
    }
    assert [r["params"]["isd_stride"] for r in report["idlm"]] == list(bench.ISD_STRIDES)
    for row in report["llada"] + report["idlm"]:
        assert 0 <= row["addition_accuracy"] <= 1
        assert row["nfe_total"] > 0 and row["answer_tokens"] > 0
    assert report["idlm"][0]["drafted"] == 0  # stride 1 drafts nothing
    assert all(r["drafted"] > 0 for r in report["idlm"][1:])


def test_decoding_modes(tmp_path: Path) -> None:
    out = tmp_path / "decoding_modes.json"
    bench = load("decoding_modes")
    bench.main(
        ["--model", "tiny-llada", "--gen-length", "8", "--block-length", "4", "--steps", "4",
         "--out", str(out)]
    )  # fmt: skip
    report = read(out)
    assert report["random_weights"] is True
    assert {(r["mode"], r["kv_cache"]) for r in report["modes"]} == {
        (m, kv) for m in bench.MODES for kv in ("none", "prefix")
    }
    assert all(r["nfe_total"] > 0 for r in report["modes"])


def test_tensor_parallel(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    load("tensor_parallel").main(
        ["--model", "tiny-llada", "--requests", "2", "--gen-length", "8", "--repeat", "1",
         "--out", str(out)]
    )  # fmt: skip
    report = read(out)
    assert report["identical_answers"] is True  # TP is exact at T = 0
    assert len(report["pairs"]) == 1 and report["tp2_over_tp1_step_time"] > 0
    # Greedy denoising: 48 bytes of statistics per position, against 2,048 for the other
    # rank's half of tiny-llada's 1,024-entry logits row.
    sampler, gather = report["sampler_bytes_per_step"], report["gather_bytes_per_step"]
    assert sampler > 0 and 40 * sampler < gather


# Slow (excluded by default; `pytest -m slow`): keeps the default suite near 10 minutes on 2 cores.
@pytest.mark.slow
def test_trimode_modes(tmp_path: Path) -> None:
    out = tmp_path / "trimode.json"
    load("trimode_modes").main(["--n", "1", "--n-other", "1", "--workers", "2", "--out", str(out)])
    report = read(out)
    assert set(report["modes"]) == {
        "ar", "diffusion", "diffusion+threshold", "linear_spec", "ar+lora", "linear_spec+lora"
    }  # fmt: skip
    assert report["modes"]["diffusion+threshold"]["forwards"] > 0
    questions = report["questions"]
    # LinearSpec is exact at T = 0, with or without the draft-only LoRA; so is ar with it loaded.
    for mode in ("linear_spec", "ar+lora", "linear_spec+lora"):
        assert report["modes"][mode]["same_as_ar"] == questions
    assert report["modes"]["ar"]["drafted"] == 0 and report["modes"]["linear_spec"]["drafted"] > 0
    assert report["ar_over_linear_spec_lora"] > 0


def test_decoding_modes_times_a_model_that_stops_early() -> None:
    """Found by QA: on the default demo-llada (which answers within its first block) the
    mid-canvas timing stepped a finished request and crashed before writing any JSON."""
    from dllm_serve.decoding.canvas import LLaDADenoiser
    from dllm_serve.decoding.params import DecodingParams
    from dllm_serve.engine.model_runner import ModelRunner
    from dllm_serve.models.loader import load_model

    bench = load("decoding_modes")
    loaded = load_model("demo-llada", device="cpu")
    prefix = LLaDADenoiser(loaded.mask_id, loaded.stop_ids, prefix_cache=True)
    ids = loaded.chat_prompt_ids([{"role": "user", "content": "What is 2 + 2?"}])
    params = DecodingParams(gen_length=64, block_length=16, steps=64)
    assert bench.run_one(ModelRunner(loaded.model, loaded.device, kv_slots=128), prefix, ids,
                         params)["finish_reason"] == "stop"  # fmt: skip
    runner = ModelRunner(loaded.model, loaded.device, kv_slots=128)
    timing = bench.forward_timing(runner, prefix, ids, params)
    assert timing["full"]["tokens"] == len(ids) + 64 and 0 < timing["cached"]["tokens"] < 64


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        ("engine_overhead", ["--requests", "0"], "argument --requests: must be >= 1, got 0"),
        ("engine_overhead", ["--repeat", "0"], "argument --repeat: must be >= 1, got 0"),
        ("engine_overhead", ["--tiny"], "--tiny shrinks a --random-* model"),
        ("gpu_llada8b", ["--iters", "0"], "argument --iters: must be >= 1, got 0"),
        ("gpu_llada8b", ["--prefix", "-16"], "argument --prefix: must be >= 0, got -16"),
        ("gpu_profile_step", ["--calls", "0"], "argument --calls: must be >= 1, got 0"),
        ("gpu_moe_layer", ["--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
        ("demo_ablation", ["--n-addition", "0"], "argument --n-addition: must be >= 1"),
        ("tensor_parallel", ["--repeat", "0"], "argument --repeat: must be >= 1"),
        ("block_diffusion", ["--prompts", "0"], "argument --prompts: must be >= 1"),
        ("trimode_modes", ["--workers", "x"], "argument --workers: must be an integer"),
        ("serving_load", ["--concurrency", "0"], "argument --concurrency: must be >= 1"),
    ],
)
def test_bad_arguments_are_one_line_errors(
    script: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by QA: tracebacks (ZeroDivisionError, IndexError, StatisticsError, ...)."""
    with pytest.raises(SystemExit) as exit_info:
        load(script).main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_accuracy_refuses_one_file_for_two_demos(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Found by QA: both demos were written to the one --out file, the second over the first."""
    monkeypatch.setattr(sys, "argv", ["demo_accuracy.py", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit) as exit_info:
        load("demo_accuracy").main()
    assert exit_info.value.code == 2
    assert "add --only llada or idlm" in capsys.readouterr().err


def test_demo_phrasings_scores_sets_context_and_typed_prompts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The measurement without a server: a model that answers every question right and
    ignores the context scores 100% everywhere; one that answers only the last word of a
    conversation wrong after a system prompt is caught by the context rows."""
    bench = load("demo_phrasings")
    sets = bench.question_sets(20)
    assert [e.question for e in sets["off_topic_named"]] == ["Hi", "Tell me a joke", "Who are you?"]
    answers = {e.messages()[-1]["content"]: e.answer for exs in sets.values() for e in exs}
    answers |= dict(bench.UNPLANNED)
    answers |= {e.question: e.answer for e in bench.fresh_reversals(20)}

    def right(conversations: list) -> list[str]:
        return [answers[c[-1]["content"]] for c in conversations]

    scores = bench.measure(right, 20)
    for name in sets:
        assert scores[name]["accuracy"] == 1.0, name
    assert scores["system_prompt"]["same"] == scores["system_prompt"]["of"]
    assert scores["system_prompt"]["changed"] == [] and scores["earlier_turn"]["changed"] == []
    assert scores["typed_by_hand_right"] == len(bench.UNPLANNED)
    assert scores["reverse_word_fresh"]["right"] == 20
    assert scores["reverse_word_fresh"]["by_phrasing"]["Can I get {w} backwards?"] == [2, 2]
    held_out = {t.text for t in REVERSAL if t.split == "held_out"}
    by = scores["reverse_word"]["by_phrasing"]
    assert set(by) <= held_out and sum(asked for _, asked in by.values()) == 20
    assert all(right == asked for right, asked in by.values())

    def confused(conversations: list) -> list[str]:
        return [
            "?" if c[0]["role"] == "system" else a
            for c, a in zip(conversations, right(conversations), strict=True)
        ]

    scores = bench.measure(confused, 20)
    assert scores["system_prompt"]["same"] == 0 and scores["earlier_turn"]["same"] > 0
    changed = scores["system_prompt"]["changed"]
    assert len(changed) == scores["system_prompt"]["of"] and scores["earlier_turn"]["changed"] == []
    first = changed[0]
    assert first["answer"] == "?" and first["alone"] == first["expected"] != "?"
    assert [m["role"] for m in first["context"]] == ["system"]

    def no_give(conversations: list) -> list[str]:
        return [
            "?" if c[-1]["content"].lower().lstrip().startswith("give me") else a
            for c, a in zip(conversations, right(conversations), strict=True)
        ]

    by = bench.measure(no_give, 20)["reverse_word"]["by_phrasing"]
    assert by["Give me {w} reversed."][0] == 0 < by["Give me {w} reversed."][1]
    assert all(right == asked for t, (right, asked) in by.items() if not t.startswith("Give"))
    monkeypatch.setattr(sys, "argv", ["demo_phrasings.py", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2
    assert "add --only llada, idlm or trimode" in capsys.readouterr().err


def test_serving_load_fails_when_nothing_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(SystemExit) as exit_info:
        load("serving_load").main(
            ["--url", f"http://127.0.0.1:{port}", "--concurrency", "1",
             "--out", str(tmp_path / "x.json")]
        )  # fmt: skip
    assert exit_info.value.code == 1
    assert f"cannot reach http://127.0.0.1:{port}" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_prefix_reuse(tmp_path: Path) -> None:
    out = tmp_path / "prefix_reuse.json"
    argv = ["--users", "2", "--turns", "2", "--system-tokens", "64", "--max-tokens", "8",
            "--repeat", "1", "--threads", "1", "--out", str(out)]  # fmt: skip
    assert load("prefix_reuse").main(argv) == 0
    report = read(out)
    assert report["same_answers"] and report["system_prompt_tokens"] >= 64
    on, off = report["on"], report["off"]
    assert on["prompt_tokens"] == off["prompt_tokens"] and on["requests"] == off["requests"] == 4
    assert off["prefill_tokens"] == off["prompt_tokens"] and off["hit_rate"] == 0.0
    # Hits skip exactly their prefill: what the model is fed drops by the tokens reused.
    assert on["prefill_tokens"] == on["prompt_tokens"] - on["cached_tokens"] < off["prefill_tokens"]
    assert off["forward_tokens"] - on["forward_tokens"] == on["cached_tokens"] > 0


def test_fresh_reversal_phrasings_are_unlike_every_trained_one() -> None:
    """No written training phrasing, nor any of 20,000 composed ones (half of them with
    unfamiliar verbs), shares a run of four words with a fresh phrasing or holds it whole."""
    import random

    from dllm_serve_train.composed import compose, too_close
    from dllm_serve_train.phrasings import REVERSAL
    from dllm_serve_train.tasks import trained_words

    fresh = tuple(load("demo_phrasings").FRESH_REVERSALS)
    held_out = tuple(t.text for t in REVERSAL if t.split == "held_out")
    rng = random.Random(11)
    trained = {t.text for t in REVERSAL if t.split == "train"}
    trained |= {compose(rng, held_out, 0.5, trained_words()) for _ in range(20000)}
    assert not set(fresh) & {t.text for t in REVERSAL}
    assert not [t for t in trained if too_close(t, fresh)]
    assert too_close("Please hand me {w}, but reversed.", fresh)  # the check can fail

"""DiffusionGemma under tensor parallelism, on CPU with gloo, 2 processes on loopback (fp32).

The forward: encoder and decoder rows (with and without a self-conditioning signal, both modes
in one batch, sliding and K = V full layers, the MoE, soft-capping) give at TP = 2 the logits of
TP = 1 within fp32 rounding, and the self-conditioning product summed over the ranks is the
dense ``probs @ E · √H``. The engine: seeded, batched requests answer token for token as at
TP = 1, with the experts sliced over the ranks or split between them (EP = 2), each denoising
row gathered whole on rank 0 once per step (the renoise sampler's documented cost); seeded
``response_format`` answers validate and equal TP = 1's; a server started with
``--tensor-parallel-size 2`` answers (whole and streamed) as the offline TP = 1 engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
import torch
from remote_server import RemoteServer
from safetensors.torch import load_file, save_file

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.engine.parallel.vocab import VocabShardedLogits
from dllm_serve.engine.workers import launch
from dllm_serve.llm import LLM
from dllm_serve.models.diffusion_gemma import DiffusionGemmaModel
from dllm_serve.models.loader import load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_diffusion_gemma

CANVAS = 16
CAUSAL, BIDIR = AttentionKind.CAUSAL, AttentionKind.BIDIRECTIONAL
QUESTIONS = ["What is 2 + 2?", "Reverse the word cat.", "Sort the letters of dcba."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = Path(tmp_path_factory.mktemp("dg-tp")) / "tiny-dg"
    return write_tiny_diffusion_gemma(out, canvas_length=CANVAS, seed=3)


@pytest.fixture(scope="module")
def sharp(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with large weights (logits well into the soft cap, random norms,
    router scales and layer scalars), so that a wrong shard or a missing all-reduce shows."""
    out = Path(tmp_path_factory.mktemp("dg-tp-sharp")) / "sharp"
    shutil.copytree(tiny, out)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(11)
    for name, t in tensors.items():
        if not name.startswith("model.decoder.") and "layer_scalar" not in name:
            continue
        noise = torch.randn(t.shape, generator=gen)
        if name == "model.decoder.embed_tokens.weight":
            t = noise
        elif name.endswith(("norm.weight", "scale")):
            t = t.float() + 0.3 * noise
        elif name.endswith("layer_scalar"):
            t = t.float() + 0.2 * noise
        elif t.dim() >= 2:
            t = noise * 0.15
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal within 1e-4 relative to the values' scale (fp32; the all-reduces only reorder
    sums)."""
    assert a.shape == b.shape
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= 1e-4 * scale, ((a - b).abs().max().item(), scale)


def steps(vocab: int, d_model: int) -> list[list[tuple[list[int], int, list[int], object, int]]]:
    """Three steps of two requests (A: a 37-token prompt, longer than the sliding window; B: 9
    tokens) as ``(tokens, start, logits_at, attention, request)``; a decoder row's soft input
    is filled in by the caller. Step 2 mixes a decoder row (with a signal) and an encoder row
    (B's canvas committed) in one batch; step 3 has a decoder row without a signal."""
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    a, b, canvas_a, canvas_b, canvas_b2 = ids(37), ids(9), ids(CANVAS), ids(CANVAS), ids(CANVAS)
    every = list(range(CANVAS))
    return [
        [(a, 0, list(range(37)), CAUSAL, 0), (b, 0, [8], CAUSAL, 1)],
        [(canvas_a, 37, every, BIDIR, 0), (canvas_b, 9, every, CAUSAL, 1)],
        [(canvas_a, 37, every, BIDIR, 0), (canvas_b2, 9 + CANVAS, every, BIDIR, 1)],
    ]


def test_tp2_forward_and_self_conditioning_equal_tp1(sharp: Path) -> None:
    one = load_model(str(sharp), dtype="float32")
    model = one.model
    assert isinstance(model, DiffusionGemmaModel)
    cfg = model.config
    assert any(not s.sliding and s.k_eq_v and s.n_kv_heads == 1 for s in cfg.layers)
    runner1 = ModelRunner(model, torch.device("cpu"), kv_slots=1024)
    two = launch(str(sharp), "cpu", "float32", 2, threads=1)
    try:
        runner2 = ModelRunner(two.model, torch.device("cpu"), kv_slots=1024,
                              parallel=two.parallel, mask_id=two.mask_id)  # fmt: skip
        local = two.model.config
        # The rank's shard: half the query heads, the sliding layers' 2 KV heads split, the full
        # layers' single K = V head replicated; the pool's slot is the widest local layer.
        assert local.n_heads == cfg.n_heads // 2 and local.vocab_size == cfg.vocab_size // 2
        assert [s.n_kv_heads for s in local.layers] == [1] * cfg.n_layers
        assert local.head_dim == max(s.head_dim for s in cfg.layers)
        pages1 = [runner1.pool.reserve(37 + 3 * CANVAS), runner1.pool.reserve(9 + 3 * CANVAS)]
        pages2 = [runner2.pool.reserve(37 + 3 * CANVAS), runner2.pool.reserve(9 + 3 * CANVAS)]
        soft = torch.randn(CANVAS, cfg.d_model, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            for n, step in enumerate(steps(cfg.vocab_size, cfg.d_model)):
                rows1, rows2 = [], []
                for tokens, start, wanted, kind, request in step:
                    signal = soft if (kind is BIDIR and request == 0) else None
                    for rows, pages in ((rows1, pages1), (rows2, pages2)):
                        pages[request].length = start
                        rows.append(RowSpec(tokens, start, wanted, kind, pages[request],
                                            model_input=signal))  # fmt: skip
                dense = runner1.run(rows1)
                sharded = runner2.run(rows2).sharded
                assert isinstance(sharded, VocabShardedLogits)
                gathered = sharded.dense(list(range(len(rows2))))
                for r, row in enumerate(rows1):
                    close(gathered[r, : len(row.logits_at)], dense.row(r))
                if n == 1:
                    assert dense.row(0).abs().max() > 20  # well into the soft cap's curve
                    # The self-conditioning signal of A's decoder row, summed over the ranks,
                    # at a temperature, and through the bf16 cast the sampler makes in bf16.
                    for cast in (None, torch.bfloat16):
                        processed = dense.row(0) / 0.7
                        if cast is not None:
                            processed = processed.to(cast)
                        want = model.soft_embedding(processed.softmax(-1, dtype=torch.float32))
                        product = sharded.soft_product([0], [0.7], cast)[0]
                        close(two.model.soft_scale(product), want)
    finally:
        two.parallel.stop()


def answers(llm: LLM, params: list[DecodingParams]) -> list[tuple[str, str | None, int]]:
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [(c.text, c.finish_reason, c.nfe) for c in llm.generate(chats, params)]


# Expert parallelism, structured output and the server at TP 2 run under -m slow (the default
# suite keeps the forward and the sliced-experts answers: the suite's 10-minute budget).
@pytest.mark.parametrize(
    "ep",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["experts-sliced", "expert-parallel"],
)
def test_tp2_answers_as_tp1(tiny: Path, ep: bool) -> None:
    """Three seeded requests in one batch, two canvases each (commits and several denoising
    steps): the same answers at TP = 2; each denoising row was gathered whole once per step."""
    params = [
        DecodingParams(gen_length=2 * CANVAS, steps=6, seed=5),
        DecodingParams(gen_length=2 * CANVAS, steps=8, seed=6, entropy_bound=0.5),
        DecodingParams(gen_length=CANVAS + 3, steps=6, seed=7),
    ]
    with LLM(str(tiny), device="cpu", dtype="float32") as llm:
        one = answers(llm, params)
    assert any(text for text, *_ in one)
    if ep:
        loaded = launch(str(tiny), "cpu", "float32", 2, threads=1, expert_parallel=True)
        llm = LLM.from_loaded(loaded)
    else:  # the public path
        llm = LLM(str(tiny), device="cpu", dtype="float32", tensor_parallel_size=2)
    with llm:
        two = answers(llm, params)
        traffic = llm.loaded.parallel.traffic
    assert two == one
    # Only denoising rows are gathered (never a prefill's or a commit's), each once a step.
    assert 0 < traffic.dense_rows < sum(nfe for *_, nfe in one)


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "grade": {"enum": ["a", "b", "c"]}},
    "required": ["ok", "grade"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_tp2_structured_output_answers_as_tp1(tmp_path: Path) -> None:
    """Under tensor parallelism the renoise sampler still enforces ``response_format``: it
    projects each emitted canvas with the rows it gathered whole on rank 0. Seeded answers
    over several 8-token canvases validate and equal TP = 1's."""
    path = write_tiny_diffusion_gemma(tmp_path / "dg8", canvas_length=8)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    chat = [{"role": "user", "content": "Answer in JSON."}]

    def run(llm: LLM) -> list[tuple[str, str | None]]:
        fields = {"response_format": fmt, "max_tokens": 64, "num_denoising_steps": 6}
        outs = [llm.chat([chat], seed=s, **fields)[0] for s in (0, 1)]
        return [(o.text, o.finish_reason) for o in outs]

    with LLM(str(path), device="cpu", dtype="float32") as llm:
        one = run(llm)
    with LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        assert not llm.engine.structured_refusals
        two = run(llm)
    assert two == one
    for text, reason in two:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.slow
def test_server_at_tp2_answers_as_tp1(tiny: Path, tmp_path: Path) -> None:
    """Through ``dllm-serve --tensor-parallel-size 2`` and the openai SDK: a seeded chat answer
    (whole and streamed) equals the offline TP = 1 answer."""
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    fields = {"max_tokens": 2 * CANVAS, "seed": 4, "num_denoising_steps": 6}
    with LLM(str(tiny), device="cpu", dtype="float32") as llm:
        want = llm.chat([chat], **fields)[0].text
    assert want
    server = RemoteServer.start(
        ["--model", str(tiny), "--tensor-parallel-size", "2", "--log-level", "warning"],
        tmp_path / "log",
    )
    try:
        client = server.client()
        body = {"model": tiny.name, "messages": chat, "max_tokens": 2 * CANVAS, "seed": 4,
                "extra_body": {"num_denoising_steps": 6}}  # fmt: skip
        reply = client.chat.completions.create(**body)
        assert reply.choices[0].message.content == want
        stream = client.chat.completions.create(**body, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    finally:
        server.stop()

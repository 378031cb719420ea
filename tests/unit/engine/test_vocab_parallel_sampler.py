"""The vocab-parallel sampler in one process: the statistics combine to the dense answer, and
every decoding algorithm, served on logits split into vocabulary shards (each shard reduced
by the same code a rank runs), gives exactly the tokens it gives on the whole logits.

The real collectives (gloo, 2 processes) are in tests/integration/test_tensor_parallel.py;
here the other ranks' parts are computed locally, so every mode and metric is cheap to cover.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

import dllm_serve
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.sampler import entropy_inverse, gumbel_argmax
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.engine.parallel.group import VocabTraffic
from dllm_serve.engine.parallel.vocab import (
    VocabOp,
    VocabShardedLogits,
    apply,
    combine_statistics,
    shard_statistics,
)
from dllm_serve.llm import LLM
from dllm_serve.models.sharding import TPShard
from dllm_serve_train.tiny_checkpoints import write_tiny, write_tiny_nemotron

DEMO_LORA = Path(dllm_serve.__file__).parent / "assets" / "demo-trimode" / "draft-lora"


@dataclasses.dataclass
class InProcessShards(VocabShardedLogits):
    """Sharded logits whose other ranks are slices of the same tensor in this process; each
    slice runs :func:`apply` exactly as a worker rank does (from the op alone)."""

    slices: tuple[torch.Tensor, ...] = ()
    greedy_op: VocabOp | None = None  # what every rank's reduce_greedy runs unasked

    @classmethod
    def of(cls, full: torch.Tensor, size: int, traffic: VocabTraffic) -> InProcessShards:
        slices = full.chunk(size, dim=-1)
        return cls(slices[0], TPShard(0, size), None, traffic=traffic, slices=slices)

    def take_greedy(self, mask_id: int) -> InProcessShards:
        self.greedy_op = VocabOp("propose", None, mask_id)
        return super().take_greedy(mask_id)

    def _collect(self, op: VocabOp | None, mine: torch.Tensor) -> list[torch.Tensor]:
        size, op = self.shard.size, op or self.greedy_op
        others = [apply(op, self.slices[r], TPShard(r, size)) for r in range(1, size)]
        self.traffic.collectives += 1
        return [mine, *others]


def test_statistics_combine_to_the_dense_proposals_and_confidences() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 48) * 4
    mask_id = 17
    z = logits.clone()
    z[..., mask_id] = float("-inf")
    for size in (1, 2, 4, 48):  # 48: one entry per shard, one shard holding only the mask
        parts = []
        for r, piece in enumerate(z.chunk(size, dim=-1)):
            parts.append(shard_statistics(piece.reshape(-1, piece.shape[-1]), r * 48 // size))
        tokens, top1, inverse = combine_statistics(torch.stack(parts))
        assert torch.equal(tokens.view(3, 5), z.argmax(-1))
        p = torch.softmax(z.double(), -1)
        want = p.gather(-1, z.argmax(-1, keepdim=True)).squeeze(-1)
        torch.testing.assert_close(top1.view(3, 5), want, rtol=1e-6, atol=0)
        torch.testing.assert_close(
            inverse.view(3, 5), entropy_inverse(z.double(), z.argmax(-1)), rtol=1e-6, atol=0
        )


def test_a_tie_across_shards_goes_to_the_first_maximum() -> None:
    z = torch.zeros(1, 8)
    z[0, 2] = z[0, 6] = 5.0  # shard 0 and shard 1 both hold the maximum
    parts = [shard_statistics(piece, r * 4) for r, piece in enumerate(z.chunk(2, -1))]
    assert combine_statistics(torch.stack(parts)).tokens.tolist() == [2] == z.argmax(-1).tolist()


def test_gumbel_draws_per_shard_equal_the_draw_over_the_whole_vocabulary() -> None:
    """The same seeded sample as TP = 1, and rank 0's generator left where TP = 1 leaves it
    (the next draw matches too); the workers draw from the state the op carries."""
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 40)
    mask_id = 3
    dense = logits.clone()
    dense[..., mask_id] = float("-inf")
    for step in range(2):
        want_gen, got_gen = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
        for _ in range(step):  # a later step: both generators already advanced alike
            gumbel_argmax(dense[1, :4], 0.7, want_gen)
            shards = InProcessShards.of(logits, 4, VocabTraffic())
            shards.propose(mask_id, [6, 4], {1: (0.7, got_gen)})
        want = gumbel_argmax(dense[1, :4], 0.7, want_gen)
        got = InProcessShards.of(logits, 4, VocabTraffic()).propose(
            mask_id, [6, 4], {1: (0.7, got_gen)}
        )
        assert torch.equal(got.tokens[1, :4], want)
        assert torch.equal(got.tokens[0], dense[0].argmax(-1))  # the greedy row
        assert torch.equal(want_gen.get_state(), got_gen.get_state())


@pytest.fixture
def sharded_runs(monkeypatch: pytest.MonkeyPatch):
    """Make every ModelRunner.run return its logits split into 2 vocabulary shards."""
    traffic = VocabTraffic()
    run = ModelRunner.run

    def sharded(self, rows):  # as rank 0's runner: the greedy reduction of every row first
        # Under tensor parallelism the logits stay laid out per row ([R, M, V / N]).
        padded = run(self, rows).as_padded()
        return InProcessShards.of(padded, 2, traffic).take_greedy(self.mask_id)

    def start() -> VocabTraffic:
        monkeypatch.setattr(ModelRunner, "run", sharded)
        return traffic

    return start


QUESTIONS = ["What is 2 + 2?", "Reverse the word cat.", "Sort the letters of dcba."]


def _generate(model: str, params: list[DecodingParams], lora: str | None = None) -> list:
    with LLM(model, device="cpu", dtype="float32") as llm:
        if lora:
            from dllm_serve.models.lora import attach_draft_lora

            attach_draft_lora(llm.loaded.model, lora)
        conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
        outs = llm.generate(conversations, params)
        return [(o.text, o.completion_tokens, o.nfe, o.committed, o.accepted_drafts) for o in outs]


def _same_on_shards(sharded_runs, model: str, params: DecodingParams, lora=None):
    seeded = dataclasses.replace(params, temperature=0.9, seed=11)
    rows = [params, seeded, dataclasses.replace(seeded, seed=12)]
    dense = _generate(model, rows, lora)
    traffic = sharded_runs()
    assert _generate(model, rows, lora) == dense
    assert traffic.reduced_positions > 0 or traffic.dense_rows > 0
    return traffic


DENOISING = [
    DecodingParams(gen_length=16, steps=8, block_length=8),
    DecodingParams(gen_length=16, steps=16, confidence_metric="entropy_inverse"),
    DecodingParams(gen_length=16, steps=16, confidence_threshold=0.3),
    DecodingParams(
        gen_length=16,
        steps=16,
        use_local_leap=True,
        local_leap_anchor_threshold=0.3,
        local_leap_neighbor_threshold=0.2,
    ),
]


@pytest.mark.parametrize("params", DENOISING, ids=["topk", "entropy", "threshold", "leap"])
def test_denoising_on_vocabulary_shards(sharded_runs, params) -> None:
    """The trained demo, whose confidences are far apart: a random tiny model's are nearly
    uniform (entropy_inverse ≈ 1/V to 9 digits), so float rounding alone reorders them."""
    traffic = _same_on_shards(sharded_runs, "demo-llada", params)
    assert traffic.dense_rows == 0  # greedy and Gumbel rows alike: statistics only


def test_self_speculation_on_vocabulary_shards(sharded_runs) -> None:
    traffic = _same_on_shards(sharded_runs, "demo-idlm", DecodingParams(gen_length=16, steps=16))
    assert traffic.dense_rows > 0  # the seeded rows' verification reads p and q whole


@pytest.mark.parametrize("family", ["dream", "sdar", "llada2", "fastdllm"])
def test_other_families_on_vocabulary_shards(sharded_runs, family, tmp_path: Path) -> None:
    path = write_tiny(family, tmp_path / family, seed=3)
    _same_on_shards(sharded_runs, str(path), DecodingParams(gen_length=16, steps=16))


@pytest.mark.parametrize("mode", ["linear_spec", "diffusion", "ar"])
def test_tri_mode_on_vocabulary_shards(sharded_runs, mode) -> None:
    params = DecodingParams(gen_length=16, steps=16, decoding_mode=mode)
    _same_on_shards(sharded_runs, "demo-trimode", params, lora=str(DEMO_LORA))


# ---- structured output on vocabulary shards ----------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))
from structured_schemas import SCHEMAS, response_format  # noqa: E402

CONVERSATION = [{"role": "user", "content": "Answer in JSON."}]
STRUCTURED_ROWS = [  # (schema or None for free text, request fields), submitted together
    ("nested", {"max_tokens": 64}),
    ("array_bounds", {"max_tokens": 64, "temperature": 0.8, "seed": 7}),
    ("int_range", {"max_tokens": 64, "confidence_threshold": 1e-6}),  # runs of several
    (None, {"max_tokens": 24}),
    (None, {"max_tokens": 24, "temperature": 0.8, "seed": 7}),
]


@pytest.mark.parametrize(
    ("family", "mode"),
    [("fastdllm", None), ("llada2", None), ("nemotron", "diffusion"),
     ("nemotron", "linear_spec"), ("nemotron", "ar")],
)  # fmt: skip
def test_structured_output_on_vocabulary_shards(sharded_runs, family, mode, tmp_path) -> None:
    """Constrained rows (greedy with the lookahead, seeded, threshold runs) beside free ones:
    on shards each gets exactly its answer on the whole logits, the constrained ones
    gathered whole (the seeded block decoders' grammar-masked seeds too) and valid. LLaDA,
    SDAR and I-DLM run under real collectives in tests/integration/test_structured_output_tp.py."""
    from dllm_serve.api.pipeline import chat_request
    from dllm_serve.offline_batch import run_together

    if family == "nemotron":
        path = write_tiny_nemotron(tmp_path / family, block_size=8, seed=1)
    else:
        path = write_tiny(family, tmp_path / family, seed=3)
    extra = {} if mode is None else {"decoding_mode": mode}

    def answers() -> list[tuple[str, str | None]]:
        with LLM(str(path), device="cpu", dtype="float32") as llm:
            requests = []
            for name, fields in STRUCTURED_ROWS:
                if mode in ("linear_spec", "ar"):  # no commit rule in self-speculation
                    fields = {k: v for k, v in fields.items() if k != "confidence_threshold"}
                grammar = {} if name is None else {"response_format": response_format(name)}
                body = json.dumps({"messages": CONVERSATION, **fields, **extra, **grammar})
                spec, ids = chat_request(llm._facts, body.encode(), "application/json")
                requests.append((ids, spec.params, spec.stop, spec.include_stop_str))
            return [(c.text, c.finish_reason) for c in run_together(llm.engine, requests)]

    dense = answers()
    traffic = sharded_runs()
    assert answers() == dense
    assert traffic.dense_rows > 0
    for (text, finish), (name, _) in zip(dense, STRUCTURED_ROWS, strict=True):
        if name is not None:
            assert finish == "stop", (name, text)
            jsonschema.validate(json.loads(text), SCHEMAS[name])

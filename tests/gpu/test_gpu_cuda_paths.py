"""The CUDA paths: the same model and engine on a GPU as on the CPU (run with ``-m gpu``).

fp32 on CUDA with TF32 off is the CPU's math in another order, so hidden states agree to
1e-4 and greedy generations token for token; bf16 is checked for closeness only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve.models.loader import load_model
from dllm_serve.models.moe import MoE
from dllm_serve_train.tiny_checkpoints import write_tiny, write_tiny_idlm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CONVERSATIONS = [
    [{"role": "user", "content": text}]
    for text in ("What is 12 + 30?", "Reverse the word cat.", "Hi", "Sort the letters of dcba.")
]


@pytest.fixture(autouse=True)
def no_tf32() -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def idlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_idlm(Path(tmp_path_factory.mktemp("idlm")) / "tiny-idlm"))


def _padded_batch(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (3, 24), generator=g)
    positions = torch.arange(24).expand(3, 24).contiguous()
    keys = torch.ones(3, 24, dtype=torch.bool)
    keys[1, 18:] = False  # a padded row
    mask = keys[:, None, None, :].expand(3, 1, 24, 24).contiguous()
    return ids.to(device), positions.to(device), mask.to(device)


@pytest.mark.parametrize("model", ["tiny-llada", "idlm"])
def test_fp32_forward_on_cuda_matches_cpu(model: str, idlm_dir: str) -> None:
    path = idlm_dir if model == "idlm" else model
    cpu = load_model(path, device="cpu", dtype="float32").model
    gpu = load_model(path, device="cuda", dtype="float32").model
    with torch.no_grad():
        want = cpu(*_padded_batch("cpu"))
        got = gpu(*_padded_batch("cuda")).cpu()
    assert (got - want).abs().max().item() <= 1e-4


def test_bf16_forward_on_cuda_is_close_to_fp32() -> None:
    fp32 = load_model("tiny-llada", device="cuda", dtype="float32").model
    bf16 = load_model("tiny-llada", device="cuda", dtype="bfloat16").model
    with torch.no_grad():
        want = fp32.lm_head(fp32(*_padded_batch("cuda"))).float()
        got = bf16.lm_head(bf16(*_padded_batch("cuda"))).float()
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.min().item() > 0.99


def _generate(
    model: str, device: str, params: DecodingParams | list[DecodingParams], **engine: object
) -> list:
    config = EngineConfig(max_waiting_requests=1 << 20, **engine)
    with LLM(model, device=device, dtype="float32", engine_config=config) as llm:
        return [(c.text, c.nfe) for c in llm.generate(CONVERSATIONS, params)]


@pytest.mark.parametrize("kv_cache", ["none", "prefix"])
def test_llada_engine_on_cuda_generates_what_cpu_generates(kv_cache: str) -> None:
    params = DecodingParams(gen_length=16, steps=16, block_length=8)
    want = _generate("tiny-llada", "cpu", params, kv_cache=kv_cache)
    assert _generate("tiny-llada", "cuda", params, kv_cache=kv_cache) == want


def test_idlm_self_speculation_on_cuda_generates_what_cpu_generates(idlm_dir: str) -> None:
    params = DecodingParams(gen_length=16, steps=16)
    want = _generate(idlm_dir, "cpu", params, isd_stride=4)
    assert _generate(idlm_dir, "cuda", params, isd_stride=4) == want


def test_llada_mixed_commit_rules_on_cuda_generate_what_cpu_generates() -> None:
    """Top-k, threshold, LocalLeap and entropy-confidence rows share each step: their per-row
    rule masks and counts reach the device through pinned, non-blocking copies
    (decoding/sampler.py)."""
    base = {"gen_length": 16, "steps": 16, "block_length": 8}
    params = [
        DecodingParams(**base),
        DecodingParams(**base, confidence_threshold=0.5),
        DecodingParams(**base, use_local_leap=True),
        DecodingParams(**base, confidence_metric="entropy_inverse"),
    ]
    want = _generate("tiny-llada", "cpu", params)
    assert _generate("tiny-llada", "cuda", params) == want


def test_seeded_self_speculation_on_cuda_is_reproducible(idlm_dir: str) -> None:
    """Sampled ISD rounds (their specs copied to the device each round) on CUDA: the same
    seed gives the same answers (CUDA and CPU generators draw different streams)."""
    params = DecodingParams(gen_length=16, steps=16, temperature=0.8, seed=7)
    first = _generate(idlm_dir, "cuda", params, isd_stride=4)
    assert _generate(idlm_dir, "cuda", params, isd_stride=4) == first
    assert all(nfe > 0 for _, nfe in first)


def test_moe_experts_run_as_grouped_gemms_on_cuda_in_bf16(tmp_path: Path) -> None:
    """A fused LLaDA2 MoE layer in bf16 on CUDA takes torch._grouped_mm (nothing read back)
    and agrees with its experts run one by one (bf16 rounding apart)."""
    loaded = load_model(str(write_tiny("llada2", tmp_path / "llada2")), device="cuda",
                        dtype="bfloat16")  # fmt: skip
    model = loaded.model.fuse_projections()
    layer = next(block.mlp for block in model.layers if isinstance(block.mlp, MoE))
    x = torch.randn(2, 24, model.config.d_model, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        grouped = layer(x)
        assert not layer.grouped_refused, "CUDA refused the grouped GEMM"
        layer.grouped_refused = True
        one_by_one = layer(x)
    cosine = torch.nn.functional.cosine_similarity(
        grouped.float().flatten(1), one_by_one.float().flatten(1), dim=-1
    )
    assert cosine.min().item() > 0.999


@pytest.mark.parametrize("variant", ["editing", "levenshtein"])
def test_llada2_editing_on_cuda_generates_what_cpu_generates(tmp_path: Path, variant: str) -> None:
    """LLaDA2.1 token editing and LLaDA2.2 insert/delete with block routing (the routing
    blocks' row offsets ride the flat batch to the device) at the checkpoints' S-mode preset:
    the same tokens and forwards on CUDA as on the CPU in fp32."""
    path = str(write_tiny("llada2", tmp_path / variant, block_size=8, **{variant: True}))
    params = DecodingParams(gen_length=16, steps=16, confidence_threshold=0.5, edit_threshold=0.0)
    assert _generate(path, "cuda", params) == _generate(path, "cpu", params)


def test_diffusion_gemma_on_cuda_is_reproducible_and_constrained(tmp_path: Path) -> None:
    """The renoise sampler on CUDA: seeded answers are reproducible (CUDA's generator draws
    another stream than the CPU's, so only CUDA against CUDA), and an answer under a JSON
    schema validates (the projected canvas; llguidance carried in .whl)."""
    grammar = pytest.importorskip("dllm_serve.decoding.grammar")
    path = str(write_tiny("diffusion_gemma", tmp_path / "dg", canvas_length=16))
    params = DecodingParams(gen_length=32, steps=8, seed=3)
    first = _generate(path, "cuda", params)
    assert _generate(path, "cuda", params) == first and all(nfe > 0 for _, nfe in first)
    constrained = DecodingParams(
        gen_length=32, steps=8, seed=1, grammar=grammar.schema_grammar(DIGIT)
    )
    for text, _ in _generate(path, "cuda", constrained):
        assert 0 <= json.loads(text)["n"] <= 9


DIGIT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["n"], "additionalProperties": False}  # fmt: skip


def test_structured_output_on_cuda_generates_what_cpu_generates() -> None:
    """The grammar masks reach the device as packed bits (one host→device copy per step) and
    the lookahead reads its window back: the same constrained answers on CUDA as on the CPU
    (demo-llada, greedy)."""
    grammar = pytest.importorskip("dllm_serve.decoding.grammar")
    params = DecodingParams(gen_length=32, steps=32, grammar=grammar.schema_grammar(DIGIT))
    want = _generate("demo-llada", "cpu", params)
    assert _generate("demo-llada", "cuda", params) == want
    assert all(0 <= json.loads(text)["n"] <= 9 for text, _ in want)

"""The offline LLM's chat/complete run the HTTP API's own request pipeline (found by QA: the
offline API had applied none of the API's rules beyond prompt checks, so fields the server
refuses ran silently; roles were not normalised; a bare stop string became one stop per
character), and its lifecycle: collected without close(), called from a running event loop,
any engine_config, a draft LoRA."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient

from dllm_serve import EngineDeadError, InvalidRequestError
from dllm_serve.api.app import build_app
from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.llm import LLM
from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.loader import load_model

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
BRIEF = [{"role": "developer", "content": "Be brief."}, *QUESTION]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM("demo-llada", device="cpu", dtype="float32") as model:
        yield model


def http(body: dict, path: str = "/v1/chat/completions") -> dict:
    engine = AsyncEngine(load_model("demo-llada", device="cpu", dtype="float32"))
    with TestClient(build_app(engine)) as client:
        return client.post(path, json=body).json()


@pytest.mark.parametrize(
    ("messages", "fields"),
    [(QUESTION, {"max_tokens": 1024}), (BRIEF, {}), (QUESTION, {"stop": "+ 2"})],
)
def test_chat_answers_what_the_server_answers(llm: LLM, messages: list, fields: dict) -> None:
    [out] = llm.chat([messages], **fields)
    reply = http({"messages": messages, **fields})
    assert out.text == reply["choices"][0]["message"]["content"]
    assert out.finish_reason == reply["choices"][0]["finish_reason"]
    usage = reply["usage"]
    assert (out.prompt_tokens, out.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert out.nfe == usage["diffusion"]["nfe"]


def test_complete_answers_what_the_server_answers(llm: LLM) -> None:
    [out] = llm.complete(["What is 2 + 2?"], max_tokens=16, ignore_eos=True)
    reply = http(
        {"prompt": "What is 2 + 2?", "max_tokens": 16, "ignore_eos": True}, "/v1/completions"
    )
    assert out.text == reply["choices"][0]["text"]
    assert out.completion_tokens == reply["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"decoding_mode": "ar"}, "decoding_mode", "not_applicable"),
        ({"stop": [""]}, "stop[0]", None),
        ({"seed": 2**64}, "seed", None),
        ({"max_tokens": 1000, "num_denoising_steps": 1000}, "num_denoising_steps", None),
        ({"top_p": 0.5}, "top_p", "unsupported_parameter"),
        ({"max_tokens": 4096}, "max_tokens", "context_length_exceeded"),
    ],
)
def test_chat_refuses_what_the_server_refuses(
    llm: LLM, fields: dict, param: str, code: str | None
) -> None:
    reply = http({"messages": QUESTION, **fields})
    with pytest.raises(InvalidRequestError) as refused:
        llm.chat([QUESTION], **fields)
    assert str(refused.value) == f"request 0: {reply['error']['message']}"
    assert (refused.value.param, refused.value.code) == (param, code)
    assert (reply["error"]["param"], reply["error"]["code"]) == (param, code)


def test_misplaced_arguments_get_a_message_about_their_own_mistake(llm: LLM) -> None:
    with pytest.raises(ValueError) as streamed:
        llm.chat([QUESTION], stream=True)
    assert str(streamed.value) == "stream is HTTP only: the offline API returns whole completions"
    with pytest.raises(ValueError, match=r"n > 1 is HTTP only"):
        llm.complete(["2 + 2 ="], n=2)
    with pytest.raises(ValueError) as keyword:
        llm.chat([QUESTION], messages=QUESTION)
    assert str(keyword.value) == "pass the messages as the first argument, not as messages="
    with pytest.raises(ValueError, match="pass the prompt as the first argument"):
        llm.complete(["2 + 2 ="], prompt="x")


def test_a_call_with_the_wrong_shape_of_arguments_says_what_to_give(llm: LLM) -> None:
    # Found by QA: complete("abc") ran three completions, one per character; a tensor prompt
    # or a dict of params failed deep inside with an unrelated error.
    with pytest.raises(TypeError, match="give a list of prompts, got str"):
        llm.complete("2 + 2 =")
    with pytest.raises(TypeError, match="wrap one conversation as \\[messages\\]"):
        llm.chat(QUESTION)
    with pytest.raises(TypeError, match="prompt 0 must be a list of token ids, got Tensor"):
        llm.generate_ids([torch.tensor([1, 2, 3])], DecodingParams(gen_length=32, steps=32))
    with pytest.raises(TypeError, match="params must be a DecodingParams"):
        llm.generate([QUESTION], {"gen_length": 32})  # type: ignore[arg-type]


def test_engine_config_of_another_type_is_refused_by_name() -> None:
    with pytest.raises(TypeError) as refused:
        LLM("tiny-llada", engine_config="x")  # type: ignore[arg-type]
    assert str(refused.value) == "engine_config must be a dllm_serve.config.EngineConfig, got str"


def test_a_closed_llm_is_a_dead_engine_for_every_call() -> None:
    # Found by QA: chat() on a closed LLM raised InvalidRequestError (a "bad request")
    # while generate() raised EngineDeadError.
    closed = LLM("tiny-llada")
    closed.close()
    with pytest.raises(EngineDeadError):
        closed.generate([QUESTION])
    for call in (lambda: closed.chat([QUESTION]), lambda: closed.complete(["x"])):
        with pytest.raises(EngineDeadError) as dead:
            call()
        assert not isinstance(dead.value, ValueError)


def test_generate_takes_one_stop_string_and_shared_params(llm: LLM) -> None:
    params = DecodingParams(gen_length=32, steps=32)
    ids = llm.engine.chat_prompt_ids(QUESTION)
    [whole] = llm.generate_ids([ids], params)
    [cut] = llm.generate_ids([ids], params, stop="+ 2")
    assert whole.text == "2 + 2 = 4" and cut.text == "2 "
    with pytest.raises(ValueError, match="stop strings must be non-empty strings"):
        llm.generate_ids([ids], params, stop=[""])


def test_chat_works_inside_a_running_event_loop(llm: LLM) -> None:
    async def notebook_cell() -> str:
        return llm.chat([QUESTION])[0].text

    assert asyncio.run(notebook_cell()) == "2 + 2 = 4"


def test_an_llm_collected_without_close_stops_its_engine() -> None:
    def engines() -> int:
        return sum(t.name == "dllm-engine" for t in threading.enumerate())

    before = engines()
    model = LLM("tiny-llada", device="cpu", dtype="float32")
    assert engines() == before + 1
    del model
    gc.collect()
    deadline = time.monotonic() + 10
    while engines() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engines() == before


def test_a_failed_request_ends_the_call_and_aborts_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The outputs reach the caller straight from the engine thread: a failure raises at once
    (not after the others' long canvases), the rest of the call is aborted, and the LLM then
    serves the next call."""
    with LLM("tiny-llada", device="cpu", dtype="float32") as model:
        engine = model.engine
        original = engine.algorithm.commit
        finished: list[str | None] = []
        send = engine._send

        def recording_send(request, output):  # type: ignore[no-untyped-def]
            if output.finished:
                finished.append(output.finish_reason)
            send(request, output)

        def commit(states, rows):  # type: ignore[no-untyped-def]
            if any(state.params.seed == 666 for state in states):
                raise RuntimeError("boom")
            return original(states, rows)

        monkeypatch.setattr(engine.algorithm, "commit", commit)
        monkeypatch.setattr(engine, "_send", recording_send)
        long = DecodingParams(gen_length=512, steps=512, block_length=32)
        bad = DecodingParams(gen_length=8, steps=8, temperature=1.0, seed=666)
        with pytest.raises(RuntimeError, match="generation failed: RuntimeError: boom"):
            model.generate_ids([[11, 12, 13]] * 3, [long, bad, long])
        deadline = time.monotonic() + 10
        while (engine.num_running or engine.num_waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_running == engine.num_waiting == 0
        assert sorted(finished, key=str) == ["abort", "abort", "error"]  # no long one ran out
        monkeypatch.undo()
        [out] = model.generate_ids([[11, 12, 13]], DecodingParams(gen_length=4, steps=4))
        assert out.finish_reason in ("stop", "length") and out.nfe > 0


def test_any_engine_config_queues_a_whole_dataset() -> None:
    with LLM("tiny-llada", device="cpu", engine_config=EngineConfig(max_waiting_requests=2)) as m:
        outs = m.generate_ids([[11, 12, 13]] * 8, DecodingParams(gen_length=4, steps=4))
    assert len(outs) == 8 and all(o.finish_reason in ("stop", "length") for o in outs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
        ({"expert_parallel": True}, "expert_parallel needs tensor_parallel_size > 1"),
    ],
)
def test_constructor_refuses_what_the_cli_refuses(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM("tiny-llada", device="cpu", **kwargs)


def test_draft_lora_is_attached_offline() -> None:
    with LLM("demo-trimode", device="cpu", draft_lora="demo-trimode-lora") as model:
        [out] = model.chat([[{"role": "user", "content": "What is 12 + 34?"}]])
        loaded = model.loaded
    assert out.text == "12 + 34 = 46"
    assert any("lora" in name.lower() for name, _ in loaded.model.named_modules())


def test_a_draft_lora_on_a_model_that_does_not_draft_is_refused() -> None:
    # Found by QA: I-DLM took the adapter and never used it (the server refused it).
    with pytest.raises(ModelLoadError, match=r"applies to tri-mode models .*'demo-idlm' is a"):
        LLM("demo-idlm", device="cpu", draft_lora="demo-trimode-lora")


@pytest.mark.parametrize(("model", "own"), [("demo-idlm", "isd"), ("tiny-llada", "diffusion")])
def test_a_mode_a_single_mode_model_lacks_is_refused(model: str, own: str) -> None:
    # Found by QA: generate_ids with decoding_mode "ar" on I-DLM decoded by ISD silently.
    with LLM(model, device="cpu") as llm:
        for mode in {"ar", "linear_spec", "diffusion", "isd"} - {own}:
            params = DecodingParams(gen_length=4, steps=4, decoding_mode=mode)
            with pytest.raises(ValueError, match=f"decoding_mode '{mode}'.* only by '{own}'"):
                llm.generate_ids([[11, 12, 13]], params)
        [out] = llm.generate_ids([[11, 12, 13]], DecodingParams(gen_length=4, steps=4,
                                                                decoding_mode=own))  # fmt: skip
    assert out.nfe >= 1 and out.finish_reason in ("stop", "length")


def test_a_mode_a_tri_mode_model_lacks_is_refused_before_the_engine() -> None:
    # Found by review: 'isd' on a tri-mode model failed inside the engine thread.
    with LLM("demo-trimode", device="cpu") as llm:
        params = DecodingParams(gen_length=4, steps=4, decoding_mode="isd")
        message = "decoding_mode 'isd'.* only by 'ar' or 'diffusion' or 'linear_spec'$"
        with pytest.raises(ValueError, match=message):
            llm.generate_ids([[11, 12, 13]], params)


def test_generate_needs_no_web_stack() -> None:
    # The GPU session's benchmarks drive LLM.generate on a machine without fastapi or
    # pydantic: only chat()/complete() may import the API's request pipeline.
    script = (
        "import sys\n"
        "for m in ('fastapi', 'pydantic', 'uvicorn', 'sse_starlette', 'starlette'):\n"
        "    sys.modules[m] = None\n"
        "from dllm_serve.decoding.params import DecodingParams\n"
        "from dllm_serve.llm import LLM\n"
        "with LLM('tiny-llada', device='cpu') as llm:\n"
        "    [out] = llm.generate_ids([[11, 12, 13]], DecodingParams(gen_length=8, steps=8))\n"
        "print(out.completion_tokens)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().isdigit()

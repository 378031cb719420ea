"""The trained demo models through a real server and the openai SDK: `dllm-serve` with no
arguments serves demo-llada, `--model demo-idlm` the I-DLM demo, `--model demo-trimode` the
tri-mode demo, and all of them answer."""

from __future__ import annotations

from pathlib import Path

from remote_server import RemoteServer

from dllm_serve.models.families.llada import LLADA
from dllm_serve.models.hub import EMBEDDED_MODELS
from dllm_serve.models.tokenization import load_tokenizer
from dllm_serve_train.off_topic import CAPABILITY_REPLY
from dllm_serve_train.tasks import STRATA, held_out_additions, held_out_set

QUESTION = [{"role": "user", "content": "What is 123 + 456?"}]


def _ask_twice(server: RemoteServer) -> tuple[object, str]:
    client = server.client()
    reply = client.chat.completions.create(model="any", messages=QUESTION)
    chunks = client.chat.completions.create(model="any", messages=QUESTION, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return reply, streamed


def test_no_arguments_serves_the_trained_llada_demo(tmp_path: Path) -> None:
    server = RemoteServer.start(["--log-level", "warning"], tmp_path / "log", pin_model=False)
    try:
        assert [m.id for m in server.client().models.list().data] == ["demo-llada"]
        reply, streamed = _ask_twice(server)
        assert reply.model == "demo-llada"
        answer = reply.choices[0].message.content
        assert answer == "123 + 456 = 579"
        assert reply.choices[0].finish_reason == "stop"
        assert streamed == answer
        diffusion = reply.usage.model_extra["diffusion"]
        assert diffusion["canvas_length"] == 32  # the model's max_new_tokens, no max_tokens sent
        # Answer tokens only: no end-of-turn token, no EOS padding.
        tokenizer = load_tokenizer(Path(EMBEDDED_MODELS["demo-llada"]), LLADA)
        assert reply.usage.completion_tokens == len(
            tokenizer.encode(answer, add_special_tokens=False)
        )
        assert diffusion["nfe"] <= 32
        # What people send out of habit: a 1024-token canvas gives the same answers (the demo's
        # mask lookahead), in the first block's forwards. Over the whole canvas the same
        # weights answer `5 + 5 = 1` and `8 + 8 = 13` at 1024.
        for question, expected in [("2 + 2", "4"), ("5 + 5", "10"), ("8 + 8", "16")]:
            ask = [{"role": "user", "content": f"What is {question}?"}]
            for max_tokens in (None, 1024):
                extra = {"max_tokens": max_tokens} if max_tokens else {}
                long = server.client().chat.completions.create(model="m", messages=ask, **extra)
                assert long.choices[0].message.content == f"{question} = {expected}"
                assert long.usage.model_extra["diffusion"]["nfe"] <= 32
        # How people ask (issue 39): no period, a greeting, after a system prompt or an earlier
        # turn; the answer is the last question's (`what is 2 + 2` after a context: below).
        system = {"role": "system", "content": "You are a helpful assistant."}
        earlier = [{"role": "user", "content": "Reverse the word cat."},
                   {"role": "assistant", "content": "tac"}]  # fmt: skip
        for question, expected in [("Reverse the word hello", "olleh"), ("Hi", CAPABILITY_REPLY)]:
            asked = {"role": "user", "content": question}
            for messages in ([asked], [system, asked], [*earlier, asked]):
                reply = server.client().chat.completions.create(model="m", messages=messages)
                assert reply.choices[0].message.content == expected, messages
                assert reply.choices[0].finish_reason == "stop"
    finally:
        server.stop()


def test_the_llada_demo_adds_after_a_system_prompt_or_an_earlier_turn(tmp_path: Path) -> None:
    server = RemoteServer.start(["--log-level", "warning"], tmp_path / "log", pin_model=False)
    try:
        system = {"role": "system", "content": "You are a helpful assistant."}
        earlier = [{"role": "user", "content": "Reverse the word cat."},
                   {"role": "assistant", "content": "tac"}]  # fmt: skip
        asked = {"role": "user", "content": "what is 2 + 2"}
        for messages in ([asked], [system, asked], [*earlier, asked]):
            reply = server.client().chat.completions.create(model="m", messages=messages)
            assert reply.choices[0].message.content == "2 + 2 = 4", messages
    finally:
        server.stop()


def test_demo_idlm_answers_with_accepted_drafts(tmp_path: Path) -> None:
    server = RemoteServer.start(
        ["--model", "demo-idlm", "--log-level", "warning"], tmp_path / "log"
    )
    try:
        reply, streamed = _ask_twice(server)
        assert reply.model == "demo-idlm"
        assert reply.choices[0].message.content == streamed == "123 + 456 = 579"
        diffusion = reply.usage.model_extra["diffusion"]
        # Self-speculation: drafts verified and mostly accepted, > 1 token per forward.
        assert diffusion["drafted_tokens"] > 0
        assert diffusion["accepted_drafts"] / diffusion["drafted_tokens"] > 0.5
        assert diffusion["nfe"] < reply.usage.completion_tokens
    finally:
        server.stop()


def test_demo_trimode_linear_spec_answers_what_ar_answers_in_fewer_forwards(
    tmp_path: Path,
) -> None:
    """demo-trimode with its draft LoRA, held-out questions: `linear_spec` (the default mode)
    gives exactly `ar`'s answers at T = 0, with fewer forwards; `diffusion` answers too."""
    server = RemoteServer.start(
        ["--model", "demo-trimode", "--draft-lora", "demo-trimode-lora", "--log-level",
         "warning"],
        tmp_path / "log",
    )  # fmt: skip
    questions = [e.question for s in STRATA for e in held_out_additions(s, 3)]
    questions += [e.question for e in held_out_set(3, task="reverse_word")]
    try:
        client = server.client()
        forwards = {"ar": 0, "linear_spec": 0}
        for question in questions:
            messages = [{"role": "user", "content": question}]
            ar = client.chat.completions.create(
                model="m", messages=messages, extra_body={"decoding_mode": "ar"}
            )
            spec = client.chat.completions.create(model="m", messages=messages)
            assert spec.choices[0].message.content == ar.choices[0].message.content, question
            forwards["ar"] += ar.usage.model_extra["diffusion"]["nfe"]
            forwards["linear_spec"] += spec.usage.model_extra["diffusion"]["nfe"]
        assert forwards["linear_spec"] < forwards["ar"]
        two = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 2 + 2?"}]
        )
        assert two.choices[0].message.content == "2 + 2 = 4"
        diffusion = client.chat.completions.create(
            model="m", messages=QUESTION, extra_body={"decoding_mode": "diffusion"}
        )
        assert diffusion.choices[0].finish_reason == "stop"
    finally:
        server.stop()

"""Training batches follow each family's objective, and a few steps overfit a fixed batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.__main__ import main
from dllm_serve_train.batches import BatchStream
from dllm_serve_train.char_tokens import keep_merge, spell_words_and_numbers
from dllm_serve_train.objectives import encode, idlm_batch, llada_batch, llada_tail_batch, loss
from dllm_serve_train.tasks import WEIGHTS, held_out_set
from dllm_serve_train.tiny_checkpoints import write_tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    out = {}
    for family in ("llada", "idlm"):
        path = write_tiny(family, Path(tmp_path_factory.mktemp(family)) / family)
        out[family] = load_model(str(path), device="cpu", dtype="float32")
    return out


def test_llada_batch_masks_only_the_answer_region(models: dict[str, LoadedModel]) -> None:
    m = models["llada"]
    exs = held_out_set(6)
    batch = llada_batch(m, exs, random.Random(0))
    for row, ex in enumerate(exs):
        prompt, answer = encode(m, ex)
        ids = batch.input_ids[row]
        assert ids[: len(prompt)].tolist() == prompt  # the prompt is never masked
        has_loss = batch.targets[row] != -100
        assert not has_loss[: len(prompt)].any()
        assert (ids[has_loss] == m.mask_id).all()  # loss only where the input is masked
        tail = batch.targets[row][len(prompt) : len(prompt) + len(answer)]
        assert all(t in (-100, a) for t, a in zip(tail.tolist(), answer, strict=True))
    assert not batch.attn_mask[0, 0, 0, batch.input_ids.shape[1] :].any()


@pytest.mark.parametrize("weighting", ["token_mean", "row_mean", "inverse_t"])
def test_llada_loss_weightings(models: dict[str, LoadedModel], weighting: str) -> None:
    """Each weighting gives masked tokens the weight its docstring states, nothing else."""
    m = models["llada"]
    batch = llada_batch(m, held_out_set(16), random.Random(3), weighting=weighting)
    masked = batch.targets != -100
    per_row = (batch.weights * masked).sum(dim=1)
    if weighting == "token_mean":
        assert batch.normalizer == masked.sum().item()
        assert (batch.weights[masked] == 1).all()
    elif weighting == "row_mean":  # every row's masked tokens weigh 1 in all: equal rows
        assert batch.normalizer == 16
        assert torch.allclose(per_row, torch.ones(16))
    else:  # 1/(t·|region|) per masked token: rows with fewer masks than expected weigh less
        assert batch.normalizer == 16
        assert not torch.allclose(per_row, torch.ones(16))
    with pytest.raises(ValueError, match="weighting"):
        llada_batch(m, held_out_set(2), random.Random(0), weighting="mean")


def test_idlm_batch_is_causal_shifted_with_trailing_masks(models: dict[str, LoadedModel]) -> None:
    m = models["idlm"]
    exs = held_out_set(8)
    batch = idlm_batch(m, exs, random.Random(1), max_stride=4)
    assert not batch.attn_mask[0, 0, 0, 1]  # causal
    for row, ex in enumerate(exs):
        prompt, answer = encode(m, ex)
        full = prompt + answer
        row_len = int(batch.attn_mask[row, 0, -1].sum())  # keys the last query may see
        ids = batch.input_ids[row, :row_len].tolist()
        tgt = batch.targets[row, :row_len].tolist()
        length = len(prompt)
        while length < len(ids) and ids[length] != m.mask_id and length < len(full):
            length += 1
        masks = [i for i, t in enumerate(ids) if t == m.mask_id]
        assert len(masks) <= 3 and masks == list(range(length, length + len(masks)))
        for j, t in enumerate(tgt):
            if t != -100:  # logit shift: position j predicts token j + 1 of the true sequence
                assert t == full[j + 1] and j + 1 >= len(prompt)


def test_idlm_ar_rows_train_next_token_prediction_over_the_whole_answer(
    models: dict[str, LoadedModel],
) -> None:
    m = models["idlm"]
    exs = held_out_set(8)
    plain = idlm_batch(m, exs, random.Random(1))
    batch = idlm_batch(m, exs, random.Random(1), ar_fraction=0.5)
    for row, ex in enumerate(exs[:4]):  # the first half: the answer clean, no MASK
        prompt, answer = encode(m, ex)
        full, p = prompt + answer, len(prompt)
        length = int(batch.attn_mask[row, 0, -1].sum())  # the row's own tokens (then padding)
        assert batch.input_ids[row, :length].tolist() == full[:-1]  # the final token: a target
        want = [-100] * (p - 1) + answer + [-100] * (batch.targets.shape[1] - len(full) + 1)
        assert batch.targets[row].tolist() == want  # position j predicts token j + 1
    # The other rows are the plain objective's (the same random draws as without AR rows).
    for row in range(4, 8):
        length = int(plain.attn_mask[row, 0, -1].sum())
        assert batch.input_ids[row, :length].tolist() == plain.input_ids[row, :length].tolist()
        assert batch.targets[row, :length].tolist() == plain.targets[row, :length].tolist()
    assert batch.normalizer == (batch.targets != -100).sum().item()
    assert any(m.mask_id in plain.input_ids[r].tolist() for r in range(4))


@pytest.mark.parametrize("family", ["llada", "idlm"])
def test_a_few_steps_overfit_one_batch(models: dict[str, LoadedModel], family: str) -> None:
    torch.manual_seed(0)
    m = models[family]
    model = m.model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    make = llada_batch if family == "llada" else idlm_batch
    batch = make(m, held_out_set(8), random.Random(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = loss(model, batch).item()
    for _ in range(30):
        opt.zero_grad()
        value = loss(model, batch)
        value.backward()
        opt.step()
    model.eval()
    assert loss(model, batch).item() < 0.5 * first


def test_causal_first_stage_then_bidirectional(models: dict[str, LoadedModel]) -> None:
    m = models["llada"]
    stream = BatchStream(m, "llada", 0, 4, WEIGHTS, 32, causal_batches=2)
    batches = [b for b, _ in zip(stream, range(3), strict=False)]
    for batch, causal in zip(batches, (True, True, False), strict=True):
        width = batch.input_ids.shape[1]
        future = torch.ones(width, width, dtype=torch.bool).triu(1)
        assert batch.attn_mask[:, 0][:, future].any() != causal  # keys right of the query
        # Same LLaDA targets either way: each masked position predicts its own token.
        masked = batch.targets != -100
        assert (batch.input_ids[masked] == m.mask_id).all()


def test_causal_steps_is_refused_for_idlm(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--family", "idlm", "--out", str(tmp_path / "x"), "--causal-steps", "5"])
    assert not (tmp_path / "x").exists()


def test_two_stream_rows_predict_each_answer_token_from_its_clean_left(
    models: dict[str, LoadedModel],
) -> None:
    """Layout, targets and positions of a two-stream row, and no leak: changing clean answer
    token j changes the hidden state of exactly the MASK queries after j."""
    m = models["llada"]
    exs = held_out_set(4, task="addition")
    batch = llada_batch(m, exs, random.Random(0), ar_fraction=0.5)
    for row, ex in enumerate(exs[:2]):  # the first half of the rows are two-stream
        prompt, answer = encode(m, ex)
        p, n = len(prompt), len(answer)
        ids = batch.input_ids[row, : p + 2 * n].tolist()
        assert ids == prompt + answer + [m.mask_id] * n
        assert batch.targets[row, : p + 2 * n].tolist() == [-100] * (p + n) + answer
        assert batch.positions[row, p + n : p + 2 * n].tolist() == list(range(p, p + n))
    for row in (2, 3):  # the rest are randomly masked rows with plain positions
        width = batch.input_ids.shape[1]
        assert batch.positions[row].tolist() == list(range(width))
    assert batch.normalizer == (batch.targets != -100).sum().item()

    prompt, answer = encode(m, exs[0])
    p, n = len(prompt), len(answer)
    with torch.no_grad():
        before = m.model(batch.input_ids, batch.positions, batch.attn_mask)[0]
        changed = batch.input_ids.clone()
        changed[0, p + 3] = answer[3] + 1  # clean answer token 3
        after = m.model(changed, batch.positions, batch.attn_mask)[0]
    moved = (before - after).abs().amax(-1)[p + n : p + 2 * n] > 1e-6
    assert moved.tolist() == [j > 3 for j in range(n)]


def test_two_stream_rows_need_a_mask_free_weighting(models: dict[str, LoadedModel]) -> None:
    m = models["llada"]
    rows = llada_batch(m, held_out_set(4), random.Random(0), weighting="row_mean", ar_fraction=1)
    per_row = (rows.weights * (rows.targets != -100)).sum(dim=1)
    assert torch.allclose(per_row, torch.ones(4)) and rows.normalizer == 4
    with pytest.raises(ValueError, match="1/t"):
        llada_batch(m, held_out_set(4), random.Random(0), weighting="inverse_t", ar_fraction=1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--family", "nemotron", "--ar-fraction", "0.5"], "for --family llada and idlm"),
        (["--family", "llada", "--ar-fraction", "1.5"], "between 0 and 1"),
    ],
)
def test_ar_fraction_is_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit):
        main([*argv, "--out", str(tmp_path / "x")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_tail_rows_are_a_long_canvas_first_block(models: dict[str, LoadedModel]) -> None:
    m = models["llada"]
    exs = held_out_set(3, task="addition")
    for seed in range(6):
        batch = llada_tail_batch(m, exs, random.Random(seed), max_canvas=300)
        for row, ex in enumerate(exs):
            prompt, answer = encode(m, ex)
            ids = batch.input_ids[row].tolist()
            region = ids[len(prompt) :]
            assert ids[: len(prompt)] == prompt
            targets = batch.targets[row].tolist()[len(prompt) :]
            has_loss = [i for i, t in enumerate(targets) if t != -100]
            assert has_loss and max(has_loss) < max(32, len(answer))  # loss in the block only
            assert all(region[i] == m.mask_id for i in has_loss)
            # Everything after the block is MASK, as while a long canvas's first block decodes.
            assert all(t == m.mask_id for t in region[max(32, len(answer)) :])
            expected = answer + [m.eos_id] * (len(region) - len(answer))
            assert all(targets[i] == expected[i] for i in has_loss)
        assert batch.attn_mask.all()  # one shared length: no padding, bidirectional
    lengths = {llada_tail_batch(m, exs, random.Random(s)).input_ids.shape[1] for s in range(40)}
    assert max(lengths) > 300 and min(lengths) < 100  # log-uniform canvases up to 1024


def test_tail_rows_pool_into_the_loss(models: dict[str, LoadedModel]) -> None:
    m = models["llada"]
    rng = random.Random(0)
    main_batch = llada_batch(m, held_out_set(4), rng)
    tail = llada_tail_batch(m, held_out_set(2), rng, max_canvas=64)
    both = loss(m.model, main_batch, tail)
    alone = [loss(m.model, b) for b in (main_batch, tail)]
    pooled = (alone[0] * main_batch.normalizer + alone[1] * tail.normalizer) / (
        main_batch.normalizer + tail.normalizer
    )
    torch.testing.assert_close(both, pooled)


def test_spelled_tokenizer_has_one_token_per_letter_and_digit(tmp_path: Path) -> None:
    assert not keep_merge("Ġh", "e") and not keep_merge("1", "2") and not keep_merge("l", "lo")
    # Upper-case letters too: "Reverse the word Hello" is answered "olleH" letter by letter.
    assert not keep_merge("W", "h") and not keep_merge("ĠH", "E")
    assert keep_merge("Ġ", "+") and keep_merge("'", "s")
    for family in ("llada", "idlm"):
        path = write_tiny(family, tmp_path / family)
        assert spell_words_and_numbers(path) > 100
        tok = load_model(str(path), device="cpu", dtype="float32").tokenizer
        for text, pieces in (("hello", 5), ("Reverse the word hello.", 23), ("579", 3),
                             ("HELLO", 5), (" Hello", 6)):  # fmt: skip
            ids = tok.encode(text, add_special_tokens=False)
            assert len(ids) == pieces, tok.convert_ids_to_tokens(ids)
            assert tok.decode(ids) == text

"""The playground at / in a real headless Chromium: type a prompt, watch it denoise.

Asserts what a person would see on a 1280x800 screen: Generate without scrolling, the canvas
starting as masked cells that the steps resolve, each committed cell shaded by (and titled
with) the confidence the trace reports for it, one chart bar per forward, a legend for every
view, blocks never decoded said in words, and the answer equal to what /v1/chat/completions
returns for the same request; for the I-DLM demo the rounds show drafts. Screenshots are saved
(DLLM_SCREENSHOT_DIR keeps them: docs/images/playground*.png are made this way).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from browser import Browser, browser_required, find_chromium
from remote_server import RemoteServer

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not browser_required(), reason="no chromium (apt-get install chromium)"
)
PROMPT = "What is 2 + 2?"
SCREEN = (1280, 800)  # a laptop screen: the viewport every test and screenshot uses
PAGE_READY = "window.playground && document.getElementById('model-info').textContent.includes('·')"


def _run_in_page(
    page: Browser,
    url: str,
    prompt: str,
    mid_run_shot: Path | None = None,
    keep_fields: bool = False,
) -> dict:
    if not keep_fields:  # a fresh page; else the fields already set stay
        page.goto(url, PAGE_READY)
    page.evaluate(f"document.getElementById('replay_ms').value = '{60 if mid_run_shot else 20}'")
    page.type_into("#prompt", prompt)
    page.evaluate("document.getElementById('generate').click()")
    if mid_run_shot is not None:  # part of the canvas resolved, part still masked
        page.wait_for("window.playground.steps >= 12", timeout=120)
        page.screenshot(mid_run_shot)
    page.wait_for("['done', 'error'].includes(window.playground.status)", timeout=120)
    return page.evaluate("JSON.parse(JSON.stringify(window.playground))")


def _chat_answer(server: RemoteServer, prompt: str) -> str:
    reply = server.client().chat.completions.create(
        model=server.client().models.list().data[0].id,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def _screenshot(page: Browser, tmp_path: Path, name: str) -> Path:
    out = Path(os.environ.get("DLLM_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    time.sleep(0.5)  # the cells' colour transitions (0.4 s) end
    page.screenshot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return path


@pytest.fixture(scope="module")
def llada_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("playground") / "server.log"
    server = RemoteServer.start(["--model", "demo-llada", "--log-level", "warning"], log)
    yield server
    server.stop()


@pytest.fixture
def page() -> Iterator[Browser]:
    assert CHROMIUM is not None, "CI needs chromium (DLLM_REQUIRE_BROWSER=1)"
    with Browser(CHROMIUM, *SCREEN) as browser:
        browser.set_viewport(*SCREEN)
        yield browser


def _trace(server: RemoteServer, body: dict) -> list[tuple[str, dict]]:
    """The trace endpoint's events for ``body``, read without the page."""
    response = httpx.post(server.url + "/v1/dllm/trace", json=body, timeout=60)
    assert response.status_code == 200, response.text
    events = []
    for record in response.text.replace("\r\n", "\n").split("\n\n"):
        lines = record.splitlines()
        names = [x[6:].strip() for x in lines if x.startswith("event:")]
        data = "".join(x[5:].strip() for x in lines if x.startswith("data:"))
        if names and data:
            events.append((names[0], json.loads(data)))
    return events


def _shown(page: Browser, selector: str) -> bool:
    """Whether ``selector`` is rendered (not hidden, not display: none)."""
    return page.evaluate(f"document.querySelector({json.dumps(selector)}).offsetParent !== null")


def test_generate_is_on_screen_without_scrolling(llada_server: RemoteServer, page: Browser) -> None:
    page.goto(llada_server.url + "/", PAGE_READY)
    assert page.evaluate("[window.innerWidth, window.innerHeight]") == list(SCREEN)
    box = page.evaluate(
        "JSON.parse(JSON.stringify(document.getElementById('generate').getBoundingClientRect()))"
    )
    assert box["top"] >= 0 and box["bottom"] <= SCREEN[1]
    assert box["height"] > 20 and box["width"] > 60
    assert page.evaluate("window.scrollY") == 0
    # The Stop button beside it, and the prompt above it, are on screen too.
    stop = page.evaluate("document.getElementById('stop').getBoundingClientRect().bottom")
    prompt = page.evaluate("document.getElementById('prompt').getBoundingClientRect().top")
    assert stop <= SCREEN[1] and 0 <= prompt < box["top"]


def test_llada_canvas_denoises_live_in_chromium(
    llada_server: RemoteServer, page: Browser, tmp_path: Path
) -> None:
    shots = Path(os.environ.get("DLLM_SCREENSHOT_DIR", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    run = _run_in_page(page, llada_server.url + "/", PROMPT, shots / "playground-denoising.png")
    assert run["status"] == "done", page.evaluate("document.getElementById('error').textContent")
    # The canvas was drawn masked, and every masked cell resolved step by step.
    assert run["maskedAfterFirstStep"] > 0
    # Positions still masked when the answer ended (after its stop id: never decoded) are
    # drawn as never needed, none as masked.
    assert run["finalMasked"] == run["neverNeeded"]
    assert run["steps"] >= 2
    cells = page.evaluate("document.querySelectorAll('#canvas .cell').length")
    assert cells == run["maxMasked"] > 0
    assert page.evaluate("document.querySelectorAll('#canvas .cell.masked').length") == 0
    shown = page.evaluate("document.getElementById('answer').textContent")
    assert shown == run["content"] != ""
    assert run["events"][0] == "start" and run["events"][-1] == "done"
    # Tri-mode's menu is not shown for a one-mode model (its display rule must not override
    # the hidden attribute).
    shown = "getComputedStyle(document.getElementById('decoding-mode-setting')).display"
    assert page.evaluate(shown) == "none"
    _screenshot(page, tmp_path, "playground.png")
    assert run["content"] == _chat_answer(llada_server, PROMPT)

    # Each cell is shaded by the confidence its commit carried in the trace (the same request
    # at temperature 0 commits the same tokens with the same confidences), and says it on hover.
    trace = _trace(llada_server, {"messages": [{"role": "user", "content": PROMPT}]})
    steps = [data for name, data in trace if name == "step"]
    expected = {
        pos: (text, conf)
        for step in steps
        for (pos, _, text), conf in zip(step["commits"], step["confidences"], strict=True)
    }
    cells = page.evaluate(
        "[...document.querySelectorAll('#canvas .cell')].map(c => "
        "[c.dataset.confidence ?? null, c.title, c.style.backgroundColor])"
    )
    # Every position but those never needed (after the answer's stop id) was committed.
    assert len(cells) == 32 and len(expected) == 32 - run["neverNeeded"]
    colours: dict[float, str] = {}
    for pos, (confidence, title, colour) in enumerate(cells):
        if pos not in expected:
            continue
        text, conf = expected[pos]
        assert conf is not None  # demo-llada places no seed tokens
        assert float(confidence) == conf
        assert title.startswith(f"{json.dumps(text)} · confidence ")
        assert float(title.split(" · confidence ")[1].split(" ")[0]) == conf
        assert colour.startswith("rgb(")
        assert colours.setdefault(conf, colour) == colour  # one confidence, one shade
    # Each shade is the page's colour of that confidence (as the legend's scale draws it), and
    # confidences a nine apart get different shades, whatever the model answers.
    shade = (
        "(c) => { const probe = document.createElement('span');"
        " probe.style.background = confidenceColor(c); return probe.style.backgroundColor; }"
    )
    for conf, colour in colours.items():
        assert page.evaluate(f"({shade})({conf})") == colour
    tiers = page.evaluate(f"[0.5, 0.9, 0.99, 0.999, 1].map({shade})")
    assert len(set(tiers)) == 5

    # The chart: one bar per step, as tall as the step's commits.
    bars = page.evaluate(
        "[...document.querySelectorAll('#chart .bar')].map(b => "
        "Number(b.querySelector('rect').getAttribute('height')))"
    )
    assert len(bars) == run["steps"] == len(steps)
    assert bars == [len(step["commits"]) for step in steps]
    assert page.evaluate("document.getElementById('chart-caption').textContent").startswith(
        "tokens committed per step"
    )
    # The canvas legend (and not the rounds') explains the shading.
    assert _shown(page, "#canvas-legend") and not _shown(page, "#rounds-legend")
    legend = page.evaluate("document.getElementById('canvas-legend').textContent")
    for words in ("masked", "shaded by the confidence it was committed with", "seed", "EOS"):
        assert words in legend
    assert _shown(page, "#confidence-scale")
    # Positions never needed (after the answer's stop id) are said in words instead of a
    # masked count; an answer that filled its canvas keeps the masked count, no note.
    assert _shown(page, "#early-note") == bool(run["neverNeeded"])
    assert _shown(page, "#masked-stat") == (not run["neverNeeded"])


def test_page_reports_a_400_from_the_server(llada_server: RemoteServer, page: Browser) -> None:
    page.goto(llada_server.url + "/", PAGE_READY)
    page.evaluate("document.getElementById('block_length').value = '5'")
    page.type_into("#prompt", PROMPT)
    page.evaluate("document.getElementById('generate').click()")
    page.wait_for("window.playground.status === 'error'", timeout=60)
    error = page.evaluate("document.getElementById('error').textContent")
    assert "'block_length' (5) must divide the canvas length (32)" in error


def _running_requests(server: RemoteServer) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    [line] = [x for x in metrics.splitlines() if x.startswith("dllm:num_requests_running")]
    return float(line.split()[-1])


def test_stop_ends_a_long_generation(llada_server: RemoteServer, page: Browser) -> None:
    # A 512-step answer replayed at 200 ms per step would hold the page for 100 s without it.
    page.goto(llada_server.url + "/", PAGE_READY)
    page.evaluate("document.getElementById('max_tokens').value = '512'")
    page.evaluate("document.getElementById('replay_ms').value = '200'")
    page.evaluate("document.getElementById('generate').click()")
    page.wait_for("window.playground.steps >= 3", timeout=60)
    assert page.evaluate("document.getElementById('generate').disabled") is True
    page.evaluate("document.getElementById('stop').click()")
    page.wait_for("window.playground.status === 'stopped'", timeout=10)
    assert page.evaluate("window.playground.steps") < 100
    assert page.evaluate("document.getElementById('status').textContent") == "stopped"
    assert page.evaluate("document.getElementById('error').hidden") is True
    assert page.evaluate("document.getElementById('generate').disabled") is False
    assert page.evaluate("document.getElementById('stop').disabled") is True
    # The closed connection aborted the request on the server.
    deadline = time.monotonic() + 15
    while _running_requests(llada_server) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running_requests(llada_server) == 0
    # And the page goes on working: the counters start again from zero.
    run = _run_in_page(page, llada_server.url + "/", PROMPT)
    assert run["status"] == "done" and run["content"] == _chat_answer(llada_server, PROMPT)


def early(n: int) -> str:
    return f"finished early: {n} positions after the answer were never needed"


def test_blocks_and_an_early_finish(
    llada_server: RemoteServer, page: Browser, tmp_path: Path
) -> None:
    """max_tokens 128 on demo-llada: four blocks of 32, drawn as four frames; the answer ends
    in the first, so the other three are never decoded, and the page says so in words (not
    "masked 96" beside "done")."""
    page.goto(llada_server.url + "/", PAGE_READY)
    page.evaluate("document.getElementById('max_tokens').value = '128'")
    page.evaluate("document.getElementById('replay_ms').value = '60'")
    page.type_into("#prompt", PROMPT)
    page.evaluate("document.getElementById('generate').click()")
    page.wait_for("window.playground.steps >= 3", timeout=60)
    # While the first block denoises, its frame is the active one.
    active = (
        "[...document.querySelectorAll('#canvas .block')].map(b => b.classList.contains('active'))"
    )
    assert page.evaluate(active) == [True, False, False, False]
    page.wait_for("['done', 'error'].includes(window.playground.status)", timeout=120)
    run = page.evaluate("JSON.parse(JSON.stringify(window.playground))")
    assert run["status"] == "done" and run["content"] == "2 + 2 = 4"
    # The three later blocks, and any position of the first after the answer's stop id.
    assert run["blocks"] == 4 and run["neverNeeded"] >= 96
    never = run["neverNeeded"]
    frames = page.evaluate(
        "[...document.querySelectorAll('#canvas .block')].map(b => "
        "[b.children.length, b.classList.contains('unused'), b.classList.contains('active')])"
    )
    assert frames == [[32, False, False]] + [[32, True, False]] * 3
    assert page.evaluate("document.querySelectorAll('#canvas .cell.unused').length") == never
    assert page.evaluate("document.getElementById('early-note').textContent") == early(never)
    assert _shown(page, "#early-note") and not _shown(page, "#masked-stat")
    title = page.evaluate("document.querySelector('#canvas .cell.unused').title")
    assert title == "never needed: the answer ended before this block"
    legend = page.evaluate("document.getElementById('canvas-legend').textContent")
    assert "block being denoised" in legend and "never needed" in legend
    _screenshot(page, tmp_path, "playground-blocks.png")
    # The next run starts from a clean slate: the note goes, the masked count comes back.
    page.evaluate("document.getElementById('generate').click()")
    page.wait_for("window.playground.steps >= 1", timeout=60)
    assert not _shown(page, "#early-note") and _shown(page, "#masked-stat")
    page.wait_for("window.playground.status === 'done'", timeout=120)
    assert page.evaluate("document.getElementById('early-note').textContent") == early(never)


def test_early_finish_on_a_phone(llada_server: RemoteServer) -> None:
    """On a phone-width page the output is scrolled into view on sending."""
    with Browser(CHROMIUM, width=390, height=844) as phone:  # type: ignore[arg-type]
        phone.goto(llada_server.url + "/", PAGE_READY)
        phone.evaluate("document.getElementById('max_tokens').value = '128'")
        run = _run_in_page(phone, llada_server.url + "/", PROMPT, keep_fields=True)
        assert run["status"] == "done" and run["content"] == "2 + 2 = 4"
        assert phone.evaluate("document.querySelectorAll('#canvas .cell').length") == 128
        assert phone.evaluate("document.querySelectorAll('#canvas .cell.masked').length") == 0
        never = phone.evaluate("document.querySelectorAll('#canvas .cell.unused').length")
        assert never >= 96 and never == run["neverNeeded"]
        text = phone.evaluate("document.getElementById('early-note').textContent")
        assert text == early(never)
        assert phone.evaluate("window.scrollY") > 0


def test_idlm_rounds_show_drafts_in_chromium(page: Browser, tmp_path: Path) -> None:
    server = RemoteServer.start(
        ["--model", "demo-idlm", "--log-level", "warning"], tmp_path / "log"
    )
    try:
        run = _run_in_page(page, server.url + "/", "What is 123 + 456?")
        assert run["status"] == "done"
        assert run["rounds"] >= 2
        # Self-speculative models get no canvas settings and no canvas.
        assert page.evaluate("document.getElementById('diffusion-settings').hidden") is True
        assert page.evaluate("document.querySelectorAll('#rounds .tok.accepted').length") > 0
        # The chart: one bar per forward (round event), accepted drafts stacked under the
        # verifier's own tokens; the rounds legend (not the canvas') is shown.
        trace = _trace(server, {"messages": [{"role": "user", "content": "What is 123 + 456?"}]})
        rounds = [data for name, data in trace if name == "round"]
        bars = page.evaluate(
            "[...document.querySelectorAll('#chart .bar')].map(b => "
            "Number(b.querySelector('rect.accepted').getAttribute('height')))"
        )
        assert len(bars) == run["roundEvents"] == run["events"].count("round") == len(rounds)
        assert bars == [r["accepted"] for r in rounds] and sum(bars) > 0
        assert _shown(page, "#rounds-legend") and not _shown(page, "#canvas-legend")
        legend = page.evaluate("document.getElementById('rounds-legend').textContent")
        for words in ("draft accepted", "draft rejected", "token emitted", "accepted drafts"):
            assert words in legend
        assert page.evaluate("document.querySelectorAll('#canvas .cell').length") == 0
        _screenshot(page, tmp_path, "playground-idlm.png")
        assert run["content"] == _chat_answer(server, "What is 123 + 456?")
    finally:
        server.stop()


def test_renoise_canvas_redraws_in_chromium(page: Browser, tmp_path: Path) -> None:
    """DiffusionGemma: the page offers only the fields that apply, draws one canvas whose
    argmax cells change step by step, and ends with the server's seeded answer."""
    from dllm_serve_train.tiny_checkpoints import write_tiny_diffusion_gemma

    model = write_tiny_diffusion_gemma(tmp_path / "dg", canvas_length=16, seed=2)
    server = RemoteServer.start(["--model", str(model), "--log-level", "warning"], tmp_path / "log")
    try:
        url = server.url + "/"
        page.goto(url, PAGE_READY)
        for field, shown in (("temperature", False), ("block_length", False),
                             ("confidence_threshold", False), ("entropy_bound", True),
                             ("num_denoising_steps", True)):  # fmt: skip
            assert _shown(page, f"#{field}") is shown, field
        page.evaluate("document.getElementById('seed').value = '3'")
        page.evaluate("document.getElementById('max_tokens').value = '24'")
        run = _run_in_page(page, url, PROMPT, keep_fields=True)
        assert run["status"] == "done", run
        assert run["steps"] == run["events"].count("renoise") > 0
        assert page.evaluate("document.querySelectorAll('#canvas .cell').length") == 16
        assert _shown(page, "#renoise-legend") and not _shown(page, "#canvas-legend")
        bars = page.evaluate("document.querySelectorAll('#chart .bar').length")
        assert 0 < bars <= run["steps"]
        _screenshot(page, tmp_path, "playground-renoise.png")
        reply = server.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=24, seed=3
        )
        assert run["content"] == reply.choices[0].message.content
    finally:
        server.stop()


def test_fractional_settings_are_sent(llada_server: RemoteServer, page: Browser) -> None:
    # The number fields take any decimal (step="any"): a step of 0.1 or 0.05 would have the
    # browser refuse 0.25 or 0.93 and send nothing.
    page.goto(llada_server.url + "/", PAGE_READY)
    for name, value in (("temperature", "0.25"), ("seed", "3"), ("confidence_threshold", "0.93")):
        page.evaluate(f"document.getElementById('{name}').value = '{value}'")
    page.type_into("#prompt", PROMPT)
    page.evaluate("document.getElementById('generate').click()")
    page.wait_for("['done', 'error'].includes(window.playground.status)", timeout=60)
    run = page.evaluate("JSON.parse(JSON.stringify(window.playground))")
    assert run["status"] == "done", page.evaluate("document.getElementById('error').textContent")


def test_trimode_rounds_have_no_blank_lines(page: Browser, tmp_path: Path) -> None:
    # LinearSpec's first forward only drafts: it draws no (empty) line; the step counter
    # counts forwards, not verified rounds; the header names the tri-mode default.
    server = RemoteServer.start(
        ["--model", "demo-trimode", "--log-level", "warning"], tmp_path / "log"
    )
    try:
        run = _run_in_page(page, server.url + "/", PROMPT)
        assert run["status"] == "done"
        info = page.evaluate("document.getElementById('model-info').textContent")
        assert "tri-mode (linear spec)" in info
        assert page.evaluate("document.getElementById('decoding_mode').value") == "linear_spec"
        assert page.evaluate("document.getElementById('diffusion-settings').hidden") is True
        lines = page.evaluate(
            "[...document.querySelectorAll('#rounds li')].map(li => li.children.length)"
        )
        assert lines and all(n > 0 for n in lines)
        step = page.evaluate("document.getElementById('stat-step').textContent")
        assert step == page.evaluate("document.getElementById('stat-nfe').textContent")
        # The menu picks the request's decoding_mode; diffusion draws a canvas and offers its
        # settings.
        pick = "const m = document.getElementById('decoding_mode'); m.value = 'diffusion';"
        page.evaluate(pick + " m.dispatchEvent(new Event('change'))")
        assert page.evaluate("document.getElementById('diffusion-settings').hidden") is False
        page.evaluate("document.getElementById('generate').click()")
        page.wait_for("['done', 'error'].includes(window.playground.status)", timeout=60)
        run = page.evaluate("JSON.parse(JSON.stringify(window.playground))")
        error = page.evaluate("document.getElementById('error').textContent")
        assert run["status"] == "done", error
        assert run["steps"] >= 1 and run["rounds"] == 0
        assert page.evaluate("document.querySelectorAll('#canvas .cell').length") > 0
        assert page.evaluate("document.querySelectorAll('#canvas .cell.masked').length") == 0
        reply = server.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": PROMPT}],
            extra_body={"decoding_mode": "diffusion"},
        )  # fmt: skip
        assert run["content"] == reply.choices[0].message.content
        # A tri-mode block starts from a seed token no confidence rule chose: drawn as a seed.
        body = {"messages": [{"role": "user", "content": PROMPT}], "decoding_mode": "diffusion"}
        seeds = [
            pos
            for name, step in _trace(server, body)
            if name == "step"
            for (pos, _, _), conf in zip(step["commits"], step["confidences"], strict=True)
            if conf is None
        ]
        assert seeds
        for pos in seeds:
            cell = f"document.querySelectorAll('#canvas .cell')[{pos}]"
            assert page.evaluate(f"{cell}.classList.contains('seed')")
            assert " · seed (no confidence) · step " in page.evaluate(f"{cell}.title")
            assert page.evaluate(f"{cell}.dataset.confidence") is None
    finally:
        server.stop()


def test_settings_wait_for_the_model_info_behind_an_api_key(page: Browser, tmp_path: Path) -> None:
    # With --api-key the info request fails until the key is typed: the page must not assume
    # a canvas model meanwhile, nor show or send denoising settings an I-DLM model refuses.
    server = RemoteServer.start(
        ["--model", "demo-idlm", "--api-key", "k-123", "--log-level", "warning"],
        tmp_path / "log",
    )
    try:
        # Guarded: the condition is polled from before the document has the element.
        info_failed = "document.getElementById('model-info')?.textContent.includes('401')"
        page.goto(server.url + "/", info_failed)
        assert page.evaluate("document.getElementById('diffusion-settings').hidden") is True
        page.evaluate("document.getElementById('block_length').value = '8'")
        page.evaluate("document.getElementById('api_key').value = 'k-123'")
        page.type_into("#prompt", "What is 123 + 456?")
        page.evaluate("document.getElementById('generate').click()")  # before any change event
        page.wait_for("['done', 'error'].includes(window.playground.status)", timeout=60)
        assert page.evaluate("window.playground.status") == "done"
        assert page.evaluate("document.getElementById('diffusion-settings').hidden") is True
        assert "·" in page.evaluate("document.getElementById('model-info').textContent")
    finally:
        server.stop()


def test_docs_and_redoc_render_from_local_files(llada_server: RemoteServer, page: Browser) -> None:
    """Swagger UI and ReDoc come from the installed package, not a CDN (this test has no
    network beyond loopback): both must actually render the schema."""
    page.goto(
        llada_server.url + "/docs", "document.querySelector('.swagger-ui .info .title') !== null"
    )
    title = page.evaluate("document.querySelector('.swagger-ui .info .title').textContent")
    assert title.startswith("dllm-serve") and "OAS 3.1" in title
    assert page.evaluate("document.querySelectorAll('.opblock').length") >= 5
    page.goto(llada_server.url + "/redoc", "document.querySelector('h1') !== null")
    assert page.evaluate("document.querySelector('h1').textContent").startswith("dllm-serve")


def test_docs_try_it_out_executes_the_chat_example(
    llada_server: RemoteServer, page: Browser
) -> None:
    """/docs: "Try it out" then "Execute" on POST /v1/chat/completions, with the body Swagger UI
    fills in from the schema's example, shows a 200 and the demo's answer."""
    op = "#operations-openai-chat_completions_v1_chat_completions_post"

    def find(selector: str) -> str:
        return f"document.querySelector({json.dumps(f'{op} {selector}')})"

    page.goto(llada_server.url + "/docs", f"{find('.opblock-summary-control')} !== null")
    page.evaluate(f"{find('.opblock-summary-control')}.click()")
    page.wait_for(f"{find('.try-out__btn')} !== null", timeout=10)
    page.evaluate(f"{find('.try-out__btn')}.click()")
    page.wait_for(f"{find('textarea.body-param__text')} !== null", timeout=10)
    body = json.loads(page.evaluate(f"{find('textarea.body-param__text')}.value"))
    assert body == {
        "model": "demo-llada",
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
    }
    page.evaluate(f"{find('.execute')}.click()")
    status = find(".live-responses-table tbody .response-col_status")
    page.wait_for(f"{status} !== null", timeout=60)
    assert page.evaluate(f"{status}.textContent.trim()") == "200"
    shown = page.evaluate(
        f"{find('.live-responses-table tbody .response-col_description')}.textContent"
    )
    assert '"content": "2 + 2 = 4"' in shown

"""The "diffusion vs OpenAI semantics" table (ADR 005), shown at /docs and pinned in README.

tests/unit/api/test_docs_consistency.py checks that README.md carries this exact table.
"""

DEVIATIONS_TABLE = """\
| OpenAI field / behaviour | dllm-serve (diffusion) semantics |
|---|---|
| `stream: true` | Emits **whole spans of text per denoising step**, not one token per event: each SSE delta is the text that became final (committed and contiguous from the start of the answer) in the latest step. Concatenated deltas equal the non-streamed answer. |
| `max_tokens` / `max_completion_tokens` | The **canvas length** (`gen_length`; default 128, or the model's `generation_config.json` `max_new_tokens` when it sets one — 32 for the demo models): the number of masked positions denoised. Output is fixed-length; the model ends shorter answers with EOS/EOT followed by padding, which is cut. `usage.completion_tokens` counts answer tokens only. |
| `finish_reason` | `stop` when the answer ends with EOS/EOT or a `stop` string; `length` when the canvas is full without one. |
| `temperature` | 0–2, **default 0** (greedy). > 0 samples each position by Gumbel-max in float64 from a per-request generator. |
| `seed` | Per request: same seed + same parameters ⇒ same answer. Ignored at temperature 0, which is seed-independent. |
| `model` | Accepted and ignored: one server serves one model; responses name the served model. |
| `top_p`, `top_k`, `n`, `presence_penalty`, `frequency_penalty`, `logit_bias`, `logprobs`, `top_logprobs`, `tools`, `tool_choice`, `functions`, `function_call` | **Rejected with HTTP 400** (autoregressive-only or deferred). Their no-op values are accepted: `top_p: 1`, `top_k: 1` (greedy), `n: 1`, penalties `0`, empty `logit_bias`/`tools`, `logprobs: false`, `tool_choice: "none"`. |
| `stop` | Up to 4 strings, as in OpenAI: the answer ends before the first occurrence (not included). Streaming holds back any tail that could start a stop string, so deltas still join to the final text. |
| non-text `response_format` | Rejected with 400 (structured output is not available yet). |
| Unknown fields | Rejected with HTTP 400 (`Unrecognized request argument supplied: …`), never silently ignored. |
| Validation errors | HTTP **400** with the OpenAI error envelope and `param`, never 422. |
| `X-Request-ID` | Honoured if sent (1–256 visible ASCII characters), else a UUIDv7; echoed on every response; the completion `id` is `chatcmpl-<X-Request-ID>`. |
| `num_denoising_steps` | Extension, 1–512, default 128 capped at the canvas length (rounded down to a multiple of the number of blocks); must be a multiple of `canvas / block_length`. |
| `block_length` | Extension, default = canvas (one fully bidirectional block); must divide the canvas. Blocks are decoded left to right. |
| `target_length` | Extension: overrides the canvas length; must not exceed `max_tokens` when both are given. |
| `block_schedule` | Extension: tokens committed per step of a block: `uniform` (default, LLaDA), `cosine` (few early, many late), `front_loaded` (many early, few late). Applies to fixed-step decoding: `cosine`/`front_loaded` together with `use_local_leap` or `confidence_threshold` are a 400. |
| `confidence_metric` | Extension: how masked positions are ranked: `top1_prob` (default, probability of the proposed token) or `entropy_inverse` (`exp(−entropy)` of the predicted distribution). Both lie in (0, 1]; thresholds are compared on this scale. |
| `attention_backend` | Extension: `sdpa` (reference, deterministic); `fa2` is deferred (400). |
| `force_single_batch` | Extension: `true` runs the request in forwards of its own (reproducible). |
| `use_local_leap`, `local_leap_anchor_threshold`, `local_leap_neighbor_threshold`, `local_leap_radius` | Extensions (LocalLeap, arXiv:2510.07081), off by default: each step commits every masked position of the block with confidence ≥ κ (anchor threshold, default 0.9), neighbours within W (radius 1–16, default 4) of such an anchor with confidence ≥ τ (default 0.75, must be ≤ κ), and always the most confident one. Forwards per block are data-dependent (≤ `block_length`); `num_denoising_steps` is then only checked for divisibility. The `local_leap_*` fields without `use_local_leap: true` are a 400. |
| `confidence_threshold` | Extension (Fast-dLLM threshold decoding), (0, 1], default off: each step commits every masked position of the block with confidence ≥ the threshold, and always the most confident one; forwards per block are data-dependent as above. Mutually exclusive with `use_local_leap` (400). |
| `usage.diffusion` | Extension in responses: `nfe` (model forward passes), `canvas_length`, `committed_tokens` and `tokens_per_forward`. |
"""

"""The "diffusion vs OpenAI semantics" table (ADR 005), shown at /docs and pinned in README.

tests/unit/api/test_docs_consistency.py checks that README.md carries this exact table.
"""

DEVIATIONS_TABLE = """\
| OpenAI field / behaviour | dllm-serve (diffusion) semantics |
|---|---|
| `stream: true` | Emits **whole spans of text per denoising step**, not one token per event: each SSE delta is the text that became final (committed and contiguous from the start of the answer) in the latest step. Concatenated deltas equal the non-streamed answer. |
| `max_tokens` / `max_completion_tokens` | The **canvas length** (`gen_length`, default 128): the number of masked positions denoised. Output is fixed-length; the model ends shorter answers with EOS/EOT followed by padding, which is cut. `usage.completion_tokens` counts answer tokens only. |
| `finish_reason` | `stop` when the answer ends with EOS/EOT; `length` when the canvas is full without one. |
| `temperature` | 0–2, **default 0** (greedy). > 0 samples each position by Gumbel-max in float64 from a per-request generator. |
| `seed` | Per request: same seed + same parameters ⇒ same answer. Ignored at temperature 0, which is seed-independent. |
| `model` | Accepted and ignored: one server serves one model; responses name the served model. |
| `top_p`, `top_k`, `n`, `presence_penalty`, `frequency_penalty`, `logit_bias`, `logprobs`, `top_logprobs`, `tools`, `tool_choice`, `functions`, `function_call` | **Rejected with HTTP 400** (autoregressive-only or deferred). Their no-op values are accepted: `top_p: 1`, `top_k: 1` (greedy), `n: 1`, penalties `0`, empty `logit_bias`/`tools`, `logprobs: false`, `tool_choice: "none"`. |
| `stop`, non-text `response_format` | Rejected with 400 (not available yet). |
| Unknown fields | Rejected with HTTP 400 (`Unrecognized request argument supplied: …`), never silently ignored. |
| Validation errors | HTTP **400** with the OpenAI error envelope and `param`, never 422. |
| `X-Request-ID` | Honoured if sent (1–256 visible ASCII characters), else a UUIDv7; echoed on every response; the completion `id` is `chatcmpl-<X-Request-ID>`. |
| `num_denoising_steps` | Extension, 1–512, default 128 capped at the canvas length (rounded down to a multiple of the number of blocks); must be a multiple of `canvas / block_length`. |
| `block_length` | Extension, default = canvas (one fully bidirectional block); must divide the canvas. Blocks are decoded left to right. |
| `target_length` | Extension: overrides the canvas length; must not exceed `max_tokens` when both are given. |
| `block_schedule`, `confidence_metric` | Extensions: `uniform` and `top1_prob` are available; `front_loaded`, `cosine`, `entropy_inverse` are rejected with 400 until implemented. |
| `attention_backend` | Extension: `sdpa` (reference, deterministic); `fa2` is deferred (400). |
| `force_single_batch` | Extension: `true` runs the request in forwards of its own (reproducible). |
| `use_local_leap`, `local_leap_anchor_threshold`, `local_leap_neighbor_threshold`, `local_leap_radius` | Extensions (LocalLeap, arXiv:2510.07081): rejected with 400 until implemented. |
| `usage.diffusion` | Extension in responses: `nfe` (model forward passes) and `canvas_length`. |
"""

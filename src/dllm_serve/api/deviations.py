"""The "diffusion vs OpenAI semantics" table, shown at /docs and pinned in README.

One line per field: it summarizes docs/api-contract.md, which has every rule's details and
its rationale.

tests/unit/api/test_docs_consistency.py checks that README.md carries this exact table.
"""

DEVIATIONS_TABLE = """\
| OpenAI field / behaviour | dllm-serve (diffusion) semantics |
|---|---|
| `POST /v1/completions` | One raw `prompt`, no chat template; `suffix` infills (LLaDA, Dream, LLaDA-MoE); `logprobs` as on chat; `echo` is a 400. |
| `stream: true` | SSE deltas are **spans of text, one per denoising step**, not single tokens; they join to the non-streamed answer. |
| `max_tokens` / `max_completion_tokens` | The **canvas length** (default: the model's `max_new_tokens`, 32 for the demos, else 128); a long canvas is decoded in blocks. |
| `finish_reason` | `stop` (EOS/EOT, a `stop` string or a `stop_token_ids` id) or `length` (the canvas filled up). |
| `temperature` | 0–2, **default 0** (greedy); above 0, Gumbel-max sampling from a per-request generator. |
| `seed`, `n` | Same seed and parameters ⇒ same answer; `n` choices draw from `seed`, `seed + 1`, …; greedy at temperature 0. |
| `model` | Accepted and ignored: one server serves one model. |
| `top_p`, `top_k`, `best_of`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`, `functions`, `function_call`, `reasoning_effort`, `audio`, `prediction`, `min_tokens`, `echo` | **400**, except their no-op values (`top_p: 1`, `best_of: 1`, `functions: []`, …). |
| `logprobs`, `top_logprobs` | Each answer token's logprob from the forward that committed (or verified) it. |
| `tools`, `tool_choice`, `parallel_tool_calls` | Template-rendered tools; `auto` answers parsed, `required`/named calls decoded under their schema. |
| `stop` | Up to 4 strings; the answer ends before the first occurrence. |
| `stop_token_ids`, `include_stop_str_in_output`, `ignore_eos` | vLLM extensions, honoured (`ignore_eos`: the whole canvas is returned). |
| `stream_options.continuous_usage_stats` | vLLM extension, honoured: the cumulative `usage` on every chunk. |
| `response_format` | `json_object`, `json_schema` **enforced** while decoding, in every decoding mode, under tensor parallelism too. |
| `store`, `service_tier`, `modalities`, `skip_special_tokens` | Accepted with the values that change nothing (`store: false`, …); others are a 400. |
| `metadata`, `user`, `prompt_cache_key`, `safety_identifier` | Accepted, informational (logged only with `--log-requests`). |
| `null` values | The same as leaving the field out. |
| `messages` | Roles `system`, `developer`, `user`, `assistant`, `tool`; an assistant message as returned (with its tool calls) goes back. |
| Unknown fields | **400** (`Unrecognized request argument supplied: …`), never silently ignored. |
| Validation errors | **400** in the OpenAI error envelope, with `param`; never 422. |
| `X-Request-ID` | Honoured (else a UUIDv7) and echoed; the completion `id` is `chatcmpl-<X-Request-ID>`. |
| `num_denoising_steps` | Extension, 1–512: forward passes in all (canvas models) or per block (block diffusion). |
| `block_length` | Extension: the block decoded at a time, left to right; must divide the canvas. |
| `target_length` | Extension: the exact canvas length, never rounded up to whole blocks. |
| `block_schedule` | Extension: tokens committed per step of a block: `uniform`, `cosine`, `front_loaded`. |
| `confidence_metric` | Extension: how positions are ranked: `top1_prob` (default) or `entropy_inverse`. |
| `attention_backend` | Extension: `sdpa`; `fa2` is a 400 (not available yet). |
| `force_single_batch` | Extension: forwards of the request's own (reproducible whatever the traffic). |
| `use_local_leap`, `local_leap_anchor_threshold`, `local_leap_neighbor_threshold`, `local_leap_radius` | Extension: LocalLeap, several commits per step near confident anchors; off by default. |
| `confidence_threshold`, `entropy_bound`, `entropy_threshold` | Extension, one per request: commit by confidence (Fast-dLLM), by an entropy sum (EB-sampler) or entropy; off by default. |
| `edit_threshold`, `max_post_edit_steps` | Extension, LLaDA2.x only: token editing (2.1's JointThreshold, 2.2's JointThresholdInDel); off by default. |
| `decoding_mode` | Extension: `ar`, `diffusion`, `linear_spec` (tri-mode models, per request) or `isd` (I-DLM). |
| `usage.diffusion` | Extension in responses: `nfe`, `canvas_length`, `committed_tokens`, `tokens_per_forward`, draft counts. |
"""

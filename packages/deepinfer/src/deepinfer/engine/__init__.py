"""The engine: requests in, `RequestOutput`s out, one scheduled step at a time.

`llm_engine.LLMEngine` builds the parts and holds one step strategy (`step_strategy`: the interface and
the synchronous loop; `async_step` with `step_pipeline`: the model thread one step ahead; `spec_step`
with `spec_decode` and `drafting`: speculative decoding; `spec_async_step`: its plain steps in the
asynchronous loop). Requests are admitted and kept in
`request_table` (per-request state in `request`, prompt checks in `prompts` with the rules in
`request_checks`, grammars in `structured`, YoCo truncation's settings in `truncation`, images expanded
and encoded in `images`); `scheduling` is
the only contact with `deepinfer_sched`.
`step_builder` turns the scheduler's output into the `step_io` dataclasses the `worker` runs (forward
and sampling), and `output_processor` commits the tokens and emits the outputs. `stats` and
`device_timing` count host and device time. Data parallel: the front in `data_parallel`, each rank's
process in `rank_process` and its vote, idle forwards and expert-parallel model in `dp_rank`; what a
rank reports of the requests an `AsyncLLM` streams, in `rank_streaming`.
"""

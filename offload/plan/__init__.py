"""What KV cache vLLM builds for a model, and how to serve it with the connector.

The modules, lightest first (this package's own import is empty, so that the
connector's run-time imports stay light):

- `policy`: the flag rule, the one place it lives: the vLLM engine arguments a
  model's groups need (`serve_flags`), the `--prefix-match-unit` rule
  (`prefix_match_unit`), the chunk sizes vLLM can hand states over at
  (`check_chunk_size`), `vllm serve` spelling (`cli_args`). No vLLM import;
  the connector imports it at run time;
- `model`: `ModelPlan` and `GroupPlan` (the plan, its text and its JSON), and
  `plan_from_engine`, the plan of a live engine's configuration (the
  connector calls it at start-up; it instantiates nothing);
- `run`: `plan_for_model` / `plan_for_models`, which run the probe in fresh
  child processes and read their results back (`PlanError`, `FlagsError`);
- `probe`: the child process, `python -m offload.plan.probe`: a replay of
  vLLM's engine start-up up to the scheduler's KV cache configuration.
"""

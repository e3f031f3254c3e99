"""The harness of tests/ and bench/: what they start and how they talk to it, in one place.

* `harness.client`: a free port, a `/v1/completions` request, /metrics read through
  prometheus_client's parser, sums of samples, medians, polling with a deadline;
* `harness.server`: a vLLM OpenAI server in a process of its own (a taken port is retried;
  its own Prometheus registry);
* `harness.engine`: offload/engine_run.py's engine runner with the test hooks (pass orders,
  gated passes, a hold until killed, ...), run in its own process;
* `harness.cli`: `kvoffload` in a process of its own, its stdout alone (parsed as JSON).

None of it ships: the product (offload/) never imports it.
"""

"""Tandem's policies inside other engines: `vllm` (a `--scheduler-cls` for vLLM) over the engine-free
`policy_bridge`."""

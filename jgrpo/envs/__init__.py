"""Environments for multi-turn episodes: the interface (`base`), the built-ins (`builtin`), tools (`tools`,
`calculator`, `sandbox`), how tools and replies become tokens (`tool_format`, `rendering`) and the worker
processes they run in (`workers`). The episodes are driven by `jgrpo.rollout.episodes` on the sampler's slot
interface."""

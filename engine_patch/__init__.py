"""KVGuard's engine side: KV block checksums computed by the workers, and their
verification by the scheduler when a KV load finishes.

Runs with or without vLLM: the scheduler and worker take small protocols
(:mod:`engine_patch.host`) that vLLM's own objects, the fake engine's and the
tests' all satisfy. Nothing here knows HTTP but
:mod:`engine_patch.vllm.errors`, the one piece of vLLM-server glue: an ASGI
middleware for vLLM's API server that puts a failed load's reason into the
request's error response.
"""

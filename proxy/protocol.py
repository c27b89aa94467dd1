"""What the proxy reads on the P/D wire that is not HTTP's or OpenAI's own.

The engines (KVGuard's fake engine and its vLLM plugin) put
``INTEGRITY_MARKER`` in the error of a load whose KV failed its checksum: a
5xx body or an SSE error event. The engine side defines the same text
(``engine_patch.scheduler.KV_CHECKSUM_FAILURE_TEXT``); a test keeps the two
equal, since the proxy imports nothing of the engine.
"""

from __future__ import annotations

INTEGRITY_MARKER = "KV checksum mismatch"

# The SSE event that ends an OpenAI stream.
DONE_EVENT = b"data: [DONE]\n\n"

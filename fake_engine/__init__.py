"""A vLLM-compatible prefill/decode engine on CPU, for the proxy's tests, the
demo and benchmarks: a deterministic byte-level model whose KV lives in
paged torch blocks per simulated TP worker, P/D transfers like vLLM's
NixlConnector in pull mode, KV checksums by the real engine_patch, and
fault injection into transfers.

Run one with ``kvguard fake-engine``; start several in a test with
:func:`fake_engine.testing.fake_engines`.
"""

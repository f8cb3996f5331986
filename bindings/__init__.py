"""The outside world: vLLM objects, a Mooncake store, KV-cache events, torch ops."""

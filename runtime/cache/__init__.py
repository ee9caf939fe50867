"""KV slot allocator, radix tree and eviction policies."""

"""kvcache service: stores KV chunks in tiers (memory, LMDB, shared Redis) behind an exact and a semantic index."""

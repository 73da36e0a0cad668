"""The engine service: one model on one device, paged KV cache, continuous batching."""

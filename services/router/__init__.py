"""The router service: picks the tier (cascade, difficulty, or the one a client names) and the
engine replica (KV-cache-aware score against load) for each request, and relays its stream."""

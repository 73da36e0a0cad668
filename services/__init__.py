"""kvmesh services: one package per box of the architecture (engine, kvcache, router, gateway, draft)."""

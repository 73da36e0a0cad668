"""kvmesh: an LLM serving stack of gRPC services around a shared KV-cache service."""

__version__ = "0.1.0"

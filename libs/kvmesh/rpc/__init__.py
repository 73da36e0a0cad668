"""gRPC plumbing shared by every kvmesh service: `entry` (serve_main, the one way a service
process runs), `server` (RpcServer, ServerSettings, run_service), `client` (make_channel,
deadlines, wait_for_ready) and `interceptors` (errors, tracing, RPC metrics)."""

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest message sent or received: a few KV chunks of a mid-size model at fp16."""

"""Sharded safetensors checkpoints: format, durable storage, the commit protocol, resume."""

"""A vLLM-compatible server around the embedded engine (`python -m rollout_bridge.serve`).

Modules: `http_server` (routes, auth, the pause gate), `openai_format` (the JSON bodies, field
by field as vLLM 0.32 writes them).
"""

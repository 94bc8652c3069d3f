"""Clients of vLLM-compatible rollout servers (a real vLLM or `python -m rollout_bridge.serve`).

Modules: `settings` (`ClientSettings`, shared by both clients), `transport` (one JSON request
with retries), `http_backend` (`HttpBackend`: one server), `pool` (`ServerPool`: several).
"""

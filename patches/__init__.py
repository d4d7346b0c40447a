"""Weaver's changes to vLLM outside vLLM's official hooks, one module each, listed with
why, how and when each can go in registry.py (shipped as ``weaver.patches``)."""

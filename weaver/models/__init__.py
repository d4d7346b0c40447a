"""Models Weaver serves, built offline: SmolLM2-135M-Instruct and random-weight Llamas.

Start at `weaver.models.registry` (`resolve_model`, `prepare_model`, `known_model_names`).
"""

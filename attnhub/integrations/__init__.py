"""Integrations of attnhub with model libraries.

- :mod:`attnhub.integrations.transformers`: ``attn_implementation="attnhub"`` for
  Hugging Face transformers models (call its ``register()`` first).

Importing this package imports no model library and registers nothing.
"""

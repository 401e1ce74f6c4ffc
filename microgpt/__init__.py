"""microgpt: small GPT training with hand-written forward/backward op pairs."""

__version__ = "0.1.0"  # the one place (pyproject.toml reads it)

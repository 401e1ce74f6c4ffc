"""microgpt: small GPT training with hand-written forward/backward op pairs."""

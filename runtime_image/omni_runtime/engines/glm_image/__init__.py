"""GLM-Image's AR stage (`ar.GlmImageArEngine`): the transformers AR whose image tokens its DiT reads."""

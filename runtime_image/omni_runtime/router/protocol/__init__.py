"""OpenAI request and response models, one module per endpoint (pydantic)."""

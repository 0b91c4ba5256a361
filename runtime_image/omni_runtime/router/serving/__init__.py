"""One serving class per OpenAI endpoint; they share `ServingBase`."""

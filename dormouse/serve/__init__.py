"""Serving a finished model: the batched decode scheduler, the OpenAI-compatible HTTP app and its chat page."""

"""Errors a user's input can cause while a model is found and loaded, importable without torch (a
service's top level turns them into one line)."""


class ModelNotFound(ValueError):
    """--model names no Hugging Face folder or .gguf file."""

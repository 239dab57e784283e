"""What a model name points to (tiny, a GGUF file or packaged id, a local folder, a hub id) and its tokenizer."""

from align.hub.names import check_model_source, load_tokenizer

__all__ = ["check_model_source", "load_tokenizer"]

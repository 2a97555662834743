"""kvedit: edit the KV cache of a live vLLM."""
__version__ = "0.1.0"

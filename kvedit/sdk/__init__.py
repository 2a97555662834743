"""The kvedit SDK: connect, request streams, batched prefill → modify → decode."""

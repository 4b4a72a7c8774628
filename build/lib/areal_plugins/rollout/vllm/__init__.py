"""``areal_vllm``: a real vLLM server process (its own environment) driven over HTTP."""

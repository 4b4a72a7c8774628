"""verl's own vLLM rollout (``rollout.name: vllm``) with what ``areal_async`` adds to it.

verl's replica, server and weight transport are used as they are; subclasses add a per-rank checksum of the
weights each vLLM worker received (``worker_extension.py``), the server calls that read it and count generated
tokens (``server.py``), and, on the CPU platform only, weight loading that works with vLLM's CPU build.
"""

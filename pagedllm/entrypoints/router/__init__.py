"""Data parallelism with cache affinity: one OpenAI endpoint in front of several pagedllm replicas.

prefix_index.py (what each replica probably has cached) -> policy.py (which replica gets a request)
-> replicas.py (health, retries) -> app.py (the HTTP face) and metrics.py (the aggregated /metrics).
"""

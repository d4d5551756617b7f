"""Compatibility Descriptors (4.1) for tests and benchmarks: a small Llama-like model's, with
the members a test or benchmark needs changed. Plain Python: the core's tests and the
benchmarks import it without Django."""

SMALL_MODEL = {
    "model": "test-llama",
    "model_digest": "sha-256:" + "1" * 64,
    "tokenizer_digest": "sha-256:" + "2" * 64,
    "layers": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "kv_dtype": "float16",
    "positional": "rope;theta=10000",
    "block_tokens": 16,
    "layout": "kvsp-layout-1",
}


def descriptor(**members) -> dict:
    """The small model's descriptor with ``members`` changed."""
    return {**SMALL_MODEL, **members}

"""The byte tokenizer's vocabulary: ids 0-255 are the UTF-8 bytes, 256 ends a document.

A module of its own so that sharding's worker processes, which import `workloads.tokens`,
never import the config models (pydantic: ~0.2 s of every worker pool's start).
"""

BYTE_VOCAB_SIZE = 257
EOD_TOKEN = 256

"""How Search-R1 encodes queries for its e5 index (its index builder and retrieval server's
defaults for e5-base-v2): mean pooling over the last hidden states, "query: " / "passage: "
prefixes, L2-normalised vectors, queries cut at 256 tokens.

`forage retriever import-index` defaults to these and records them in the manifest. A module of
constants alone, so the command line's parser reads them without importing the import code.
"""

from __future__ import annotations

QUERY_PREFIX = "query: "
PASSAGE_PREFIX = "passage: "
POOLING = "mean"
QUERY_MAX_LENGTH = 256

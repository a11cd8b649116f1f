"""The KV cache's books, pure Python: blocks, prefix hashes, saved states."""

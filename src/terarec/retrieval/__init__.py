"""Retrieval: model slices (slices.py) and the faiss item-vector index (index.py)."""

"""Remotes: the interface and storing a pulled entry (base), the scheme table with the folder and
Hugging Face Hub remotes and their pack format (schemes), the object stores through fsspec (objectstore:
S3, GCS, Azure, memory) and push and pull between a cache and a remote (sync)."""

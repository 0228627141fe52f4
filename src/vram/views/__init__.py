"""Layer 3, views of an allocator's state: `summary` (``memory_summary()`` text), `snapshot`
(``memory_snapshot()`` / ``_snapshot()`` in PyTorch's format) and `plot` (matplotlib, optional)."""

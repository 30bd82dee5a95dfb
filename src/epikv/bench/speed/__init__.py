"""Decode tokens/s and compaction cost per policy (``study``)."""

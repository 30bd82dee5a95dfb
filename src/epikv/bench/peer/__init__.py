"""Side by side with NVIDIA kvpress (``study``; kvpress runs in its own environment through the
self-contained ``kvpress_runner`` script)."""

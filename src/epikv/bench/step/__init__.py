"""The decode step against the memory-traffic bound (``study``)."""

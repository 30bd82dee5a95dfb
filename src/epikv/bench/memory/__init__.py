"""Peak memory of one forward pass vs length (``study``), one capped point per process (``worker``)."""

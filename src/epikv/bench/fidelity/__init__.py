"""Agreement with the full cache on the same text: the plan and run (``study``), one cell's
traces (``runs``), tables (``summary``), figures (``plots``) and the text genres (``genres``)."""

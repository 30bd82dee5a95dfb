"""Free-running loops, cap hits and accuracy at equal peak memory: the plan and resumable run
(``study``), one cell's packed generation (``runs``), statistics and tables (``summary``), figures
(``plots``)."""

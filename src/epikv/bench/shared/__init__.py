"""What the studies share: result documents (``documents``), machine facts and memory probes
(``machine``), model and prompt loading (``model_loading``, ``prompt_loading``), figures
(``figures``, ``ci_plots``), finished parts kept on disk (``parts``), statistics
(``stats``: bootstrap intervals, equal-peak budgets; ``paired``: Wilson intervals, exact McNemar)."""

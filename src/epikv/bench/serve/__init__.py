"""``epikv serve`` under concurrent clients: the sweep and capacity run (``study``), the clients
(``clients``), the burst soak (``soak``)."""

"""``epikv bench goodput``: what a fixed KV pool buys, through vLLM (issue 56, part 3)."""

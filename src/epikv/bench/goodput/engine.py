"""The vLLM client of ``epikv bench goodput``: the eval's :class:`VllmGenerator` on a fixed KV pool.

Three changes to the eval's client, all in the start message and the replies: the pool is exactly
``pool_tokens`` usable tokens (the worker's ``pool_tokens``), not room for every request at its
longest, so vLLM queues and preempts as it would with that memory; ``full`` runs on plain vLLM (the
worker's ``plain``: no plugin in the engine at all); each generate reply's scheduler statistics (the
most requests running at once, preemptions, steps) are kept as :attr:`PoolGenerator.stats`.
Tokenizer, prompt ids, seeds, stop ids and completions are the eval's, unchanged.

Does not know: tasks, grading or the cells of the study (``study.py``).
"""

from __future__ import annotations

from typing import Any

from epikv.eval.vllm_generator import BLOCK, VllmGenerator, VllmWorkerError

FULL = "full"


class PoolGenerator(VllmGenerator):
    """One (policy, budget) of the study on a vLLM worker whose KV pool holds ``pool_tokens`` tokens
    (set by :meth:`size_pool` before the first call); ``full`` on plain vLLM."""

    def __init__(
        self,
        model: str | None,
        policy: str,
        budget: int | None,
        interval: int | None,
        *,
        rank_every: int | None,
        dtype: str,
        max_new_tokens: int,
        max_num_seqs: int,
        eager: bool,
        python: str | None = None,
    ) -> None:
        ranking = {} if rank_every is None else {"rank_every": rank_every}
        super().__init__(
            model, policy, budget, interval, {}, dtype=dtype, max_new_tokens=max_new_tokens,
            max_num_seqs=max_num_seqs, enforce_eager=eager, python=python, **ranking,
        )  # fmt: skip
        self.plain = policy == FULL
        self.start_msg["plain"] = self.plain
        self.stats: dict[str, Any] = {}

    def size_pool(self, pool_tokens: int) -> None:
        """The KV pool, in tokens (whole blocks of :data:`BLOCK`), the worker starts with."""
        if pool_tokens < BLOCK or pool_tokens % BLOCK:
            raise ValueError(f"pool_tokens must be whole blocks of {BLOCK} tokens, got {pool_tokens}")
        self.start_msg["pool_tokens"] = pool_tokens

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        reply = super()._ask(msg)
        if msg["op"] == "start":
            return self._started(msg, reply)
        if msg["op"] == "generate":
            self.stats = {"wall_s": reply["wall_s"], **reply["scheduler"]}
        return reply

    def _started(self, msg: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
        if msg.get("pool_tokens") is not None and reply["pool_tokens"] != msg["pool_tokens"]:
            raise VllmWorkerError(
                f"vLLM sized a pool of {reply['pool_tokens']} tokens, not {msg['pool_tokens']}"
            )
        if self.plain != reply["plain"]:
            raise VllmWorkerError(f"asked plain={self.plain}, the worker started plain={reply['plain']}")
        if self.plain:  # no plugin ran: the spec is this side's `full` (it keeps every token)
            return {**reply, "spec": self.spec.config()}
        return reply

"""What P and D report of their pools in HealthReply."""
from __future__ import annotations

from common.dflash.proposer import DraftPages
from common.engine.engine import Engine


def pool_health(engine: Engine) -> dict[str, int]:
    """The engine's pools as HealthReply fields: KV pages, draft KV pages and state slots, free
    and total (a pool the engine does not have is 0 of 0)."""
    runner, draft, states = engine.runner, engine.proposer, engine.runner.state_pool
    draft_pool = draft.pool if isinstance(draft, DraftPages) else None
    return {"free_pages": runner.pool.num_free, "total_pages": runner.pool.num_pages,
            "free_draft_pages": draft_pool.num_free if draft_pool else 0,
            "total_draft_pages": draft_pool.num_pages if draft_pool else 0,
            "free_state_slots": states.num_free if states else 0, "total_state_slots": states.num_slots if states else 0}

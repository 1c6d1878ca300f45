"""The per-request meta_info reported to clients (HTTP and gRPC)."""
from __future__ import annotations

import time

from common.engine.request import Request


def meta_info(req: Request) -> dict:
    spec = req.spec.meta(len(req.output_ids)) if req.spec is not None else {}
    return spec | {
        "id": req.rid,
        "prompt_tokens": req.prompt_len,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,  # no prefix cache yet
        "finish_reason": req.finish_reason,
        "matched_stop": req.matched_stop,
        "e2e_latency": time.monotonic() - req.arrival,
        "verified_pages": req.verified_pages,
        "transfer_bytes": req.transfer_bytes,
        "transfer_transport": req.transfer_transport,
    }

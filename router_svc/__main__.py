"""python -m router_svc --port P --policy pd --prefill host:port --decode host:port
python -m router_svc --port P --policy round_robin --replicas host:port,host:port"""
from __future__ import annotations

import logging
import sys

import uvloop

from router_svc.config import parse_args


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)  # before the heavy imports (torch, transformers): bad flags fail fast
    from common.model.errors import ModelNotFound
    from router_svc.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    try:
        uvloop.run(serve(cfg))
    except (ModelNotFound, OSError) as e:  # a bad --model or a port in use: one line, no traceback
        print(f"router: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

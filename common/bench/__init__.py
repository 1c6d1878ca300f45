"""The benchmarks users judge a stack with, run against a router URL (docs/BENCHMARKS.md):

- `gsm8k.py`    `pdflash bench gsm8k`: few-shot GSM8K accuracy, throughput, both accept lengths,
                 the accept-histogram invariants checked for every request.
- `serving.py`  `pdflash bench serving`: streaming TTFT/TPOT/ITL/E2E at a fixed concurrency.
- `ab.py`       `pdflash bench ab`: one of the two against several stacks it starts itself, compared.

Shared parts: `client.py` (HTTP requests with progress), `warmup.py` (one request to every
replica), `stats.py` (percentiles, accept lengths, invariants), `report.py` and `plot.py`
(JSON, JSONL, markdown, PNG), `stack.py` (`pdflash up` as a child process).
"""

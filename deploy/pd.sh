#!/usr/bin/env bash
# deploy/pd.sh: one entry point for a pdflash experiment (start | bench | logs | stop | status | all).
# The logic lives in deploy/pdeploy (standard-library Python, so the machine that drives the
# cluster needs only python3, ssh and scp); `deploy/pd.sh --help` lists the commands.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$repo/deploy${PYTHONPATH:+:$PYTHONPATH}" exec "${DEPLOY_PYTHON:-python3}" -m pdeploy "$@"

#!/usr/bin/env bash
# A Python virtual environment with the pinned `openai` and `ollama` clients that
# tests/serve_clients.rs drives `merg serve` with (tests/serve/requirements.txt). Reused while
# the requirements are unchanged. Prints the environment's python on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
req=tests/serve/requirements.txt
venv="${MERG_PY_CLIENTS:-$HOME/.cache/merg/py-clients}"
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [[ ! -x "$venv/bin/python" || "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    python3 -m venv --clear "$venv" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
    echo "$want" > "$stamp"
fi
echo "$venv/bin/python"

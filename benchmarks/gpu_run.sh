#!/usr/bin/env bash
# The one command a lent GPU machine runs (docs/benchmarks.md, "The GPU check"): it installs the carried
# wheels (`make gpu-wheels` made them here) into a private folder with no network, runs
# benchmarks/gpu_check.py inside the deadline, and writes at most 8 small files to OUT:
#   gpu_run.log      everything printed (this script's lines and the check's)
#   gpu_check.json   the report, every section and row (rewritten by the check as it goes)
#   gpu_check.md     the same as tables
#   runs.tar.gz      each run's log, recipe, metrics.jsonl and throughput.json; never checkpoints or weights
# Checkpoints, shards and the tokenizer stay in a temporary folder outside OUT.
#
#   bash benchmarks/gpu_run.sh OUT [--deadline-s N] [--wheels DIR] [--smoke] [gpu_check options...]
#
# --deadline-s: this whole command, install and packing included (default 400: with a machine's start, one
# call of about 480 s). --wheels: the carried wheels (default .whl; none there: the Python's own packages).
# --smoke: CPU, tiny shapes (the suite runs it, so this script cannot rot). Exit: gpu_check.py's status,
# 2 if the carried wheels are wrong or do not install.
set -uo pipefail

usage="usage: bash benchmarks/gpu_run.sh OUT [--deadline-s N] [--wheels DIR] [--smoke] [gpu_check options]"
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
out=$1
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
deadline=400
wheels=$repo/.whl
pass=()
while [ $# -gt 0 ]; do
  case $1 in
    --deadline-s) deadline=${2:?--deadline-s needs seconds}; shift 2 ;;
    --wheels) wheels=${2:?--wheels needs a folder}; shift 2 ;;
    *) pass+=("$1"); shift ;;
  esac
done
case $deadline in ''|*[!0-9]*) echo "--deadline-s: whole seconds, got '$deadline'" >&2; exit 2 ;; esac
mkdir -p "$out" || exit 2
pack_s=15  # what copying the results and the archive may take after the check

run() {
  local start work rc left
  start=$(date +%s)
  work=$(mktemp -d "${TMPDIR:-/tmp}/numloss-gpu-run.XXXXXX") || return 2
  trap 'rm -rf "$work"' RETURN
  export PYTHONUNBUFFERED=1
  echo "gpu_run: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $($python -V 2>&1), deadline ${deadline} s, work $work"
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  if compgen -G "$wheels/*.whl" >/dev/null; then
    "$python" "$repo/benchmarks/gpu_wheels.py" check --dest "$wheels" || return 2
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
      "$wheels"/*.whl || { echo "gpu_run: the carried wheels did not install" >&2; return 2; }
    export PYTHONPATH="$work/site:$repo${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_run: installed into $work/site: $(cd "$work/site" && ls -d ./*.dist-info | sed 's|^\./||' | tr '\n' ' ')"
  else
    echo "gpu_run: no carried wheels in $wheels: the check uses what $python has"
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
  fi
  left=$(( deadline - ($(date +%s) - start) - pack_s ))
  if [ "$left" -lt 30 ]; then
    echo "gpu_run: ${left} s left of the ${deadline} s deadline after the install: not starting the check" >&2
    return 3
  fi
  echo "gpu_run: the check gets ${left} s"
  # the check ends its own sections by its deadline; the timeout is for a check that hangs regardless
  timeout --kill-after=10 $(( left + 20 )) "$python" "$repo/benchmarks/gpu_check.py" --out "$work/check" \
    --deadline-s "$left" "${pass[@]}"
  rc=$?
  for name in gpu_check.json gpu_check.md; do
    [ -f "$work/check/$name" ] && cp "$work/check/$name" "$out/$name"
  done
  (cd "$work/check" 2>/dev/null && find . -type f \( -name '*.log' -o -name '*.yaml' -o -name 'metrics.jsonl' \
      -o -name 'throughput.json' -o -name '*-junit.xml' -o -name 'losses.json' -o -name 'recipe_history.jsonl' \) \
      -not -path '*/checkpoints/*' -not -path '*/final/*' -size -4M -print0 | tar czf "$out/runs.tar.gz" --null -T -)
  echo "gpu_run: exit $rc after $(( $(date +%s) - start )) s; in $out: $(cd "$out" && ls | tr '\n' ' ')"
  return $rc
}

run 2>&1 | tee "$out/gpu_run.log"
exit "${PIPESTATUS[0]}"

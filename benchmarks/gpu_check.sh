#!/usr/bin/env bash
# The GPU check of libra_jax's CUDA paths, in one script, under its own budget (< 5 minutes).
#
#   bash benchmarks/gpu_check.sh            # on a GPU machine (the `device` tool)
#   bash benchmarks/gpu_check.sh --dry-run  # anywhere with nvcc: build, host-side checks
#
# Builds the project once (no network: nvcc, CMake, ninja, nanobind, scikit-build-core and
# jax with its CUDA plugin must be installed; set PYTHON if `python3` is not the one with
# jax): one CMake build, through pip into a private site directory, makes both the Python
# extension and the harness. Every step runs from outside the repository (so Python imports
# the built package, never the source tree), under a timeout cut to the time left, fails
# soft, and writes as it goes. Steps: the import check, the harness selftest, the CUDA tests
# (tests/test_cuda.py, tests/test_platform_matrix.py), the harness on the GPU (check: N = 2,
# 4, 8 virtual ranks against a float64 reference; contend: the contention curves), the
# curves' fitted profile, start/done beside compute (gpu_overlap.py), the machine's NCCL
# under libra's CTA limits (gpu_nccl_check.py: all-reduce, reduce-scatter, all-gather; on NCCL
# >= 2.31 both CTA routes, a bucket of 3 and of 8 members as one group timed on each, side by
# side: the numbers that decide the route's default), whether jaxlib's command buffers
# capture custom calls and keep libra's P2P call out (gpu_overlap.py --command-buffers), and
# time vs bytes x
# blocks (bench; with a bucket of 8 members against one buffer of its bytes, bench_members).
# libra's GPU data paths are opt-in (LIBRA_JAX_CUDA); this script opts in per step.
#
# What the FSDP simulation (benchmarks/paper_reproduction.py --fsdp) assumes and a GPU run must
# measure before its numbers mean anything on hardware: (1) NCCL's reduce-scatter and
# all-gather time vs CTAs, alone, across ranks (gpu_nccl_check.py times them on one rank, a
# copy: the handlers and CTA routes, not the ring); (2) a GEMM's slowdown beside an in-flight
# reduce-scatter or all-gather vs CTAs (the `contend` curves are the all-reduce's, and the
# model takes them for all three collectives); (3) whether a gather and a reduce-scatter in
# flight together share the link (the simulation lets them overlap freely). None of the three
# is measured here yet: it needs two GPUs for (1) and (3), and a contend mode per collective.
#
# Results under $OUT (default /tmp/libra_gpu_check/out), at most 6 files, each written as
# it comes, so a run killed midway still returns them:
#   summary.txt                one line per step, then the time-vs-blocks table
#   log.txt                    every step's output, one rolling log (the last 2 MiB)
#   harness.csv                the harness's check (with a bucket's members in one launch),
#                              contend and bench lines
#   h200-virtual-ranks.json    the h200 profile with contention fitted to the proxy curves
#                              (a separate, labelled profile: h200.json is not replaced)
#   overlap.md                 gpu_overlap.py's tables
# Exit status: 0 if no step failed (a SKIP is not a failure).
#
# Environment: PYTHON, OUT, GPU_CHECK_BUDGET_S (total seconds, default 280),
# LIBRA_CUDA_FROM_WHEELS (ON: compile with $PYTHON's nvidia-cuda-nvcc wheel; default AUTO:
# the wheel only where no other nvcc is found),
# GPU_CHECK_MAX_BYTES (largest size timed, default 256M), GPU_CHECK_RANKS (default 2,4,8),
# CUDA_ARCH (default 90: the H200), GPU_CHECK_WORK (build directory).
set -uo pipefail

dry_run=0
case "${1:-}" in
  --dry-run) dry_run=1 ;;
  "") ;;
  -h|--help) sed -n '2,36p' "$0"; exit 0 ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/libra_gpu_check/out}
budget=${GPU_CHECK_BUDGET_S:-280}
max_bytes=${GPU_CHECK_MAX_BYTES:-256M}
ranks=${GPU_CHECK_RANKS:-2,4,8}
arch=${CUDA_ARCH:-90}
python=${PYTHON:-python3}
work=${GPU_CHECK_WORK:-/tmp/libra_gpu_check/work}
mkdir -p "$out" "$work"
summary=$out/summary.txt
log=$out/log.txt
csv=$out/harness.csv
: > "$summary"
: > "$log"
: > "$csv"
status=0
reserve=10        # seconds kept back for the table and the summary
min_step=5        # a step with less time than this is skipped
max_log=$((2 << 20))

note() {  # note STEP RESULT DETAIL: one line in summary.txt (and on stdout, as it comes)
  printf '%-16s %-5s %s\n' "$1" "$2" "$3" | tee -a "$summary"
  [ "$2" = FAIL ] && status=1
  return 0
}
left() { echo $((budget - SECONDS)); }

roll_log() {  # keep the log's last $max_log bytes
  local size
  size=$(stat -c %s "$log" 2>/dev/null || echo 0)
  if [ "$size" -gt "$max_log" ]; then
    tail -c "$max_log" "$log" > "$work/log.tail" && cat "$work/log.tail" > "$log"
  fi
}

# step NAME CAP_S CMD...: runs CMD with a timeout of CAP_S seconds, cut to the time left
# (less the reserve), its output appended to log.txt. Returns CMD's status (124: timed
# out); 125 without running it when the budget has no room (the step is noted SKIP).
step() {
  local name=$1 cap=$2 t rc
  shift 2
  t=$(( $(left) - reserve ))
  [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt "$min_step" ]; then
    note "$name" SKIP "budget: $(left)s of ${budget}s left"
    return 125
  fi
  echo "=== $name: $* (timeout ${t}s, at ${SECONDS}s) ===" >> "$log"
  timeout --kill-after=5 "$t" "$@" >> "$log" 2>&1
  rc=$?
  [ $rc -eq 124 ] && echo "=== $name: timed out after ${t}s ===" >> "$log"
  roll_log
  return $rc
}

# Which nvcc: LIBRA_CUDA_FROM_WHEELS=ON takes the nvidia-cuda-nvcc wheel in $python's
# site-packages (CMakeLists.txt's discovery; what a pip-only JAX GPU user has), as does a
# machine with no toolkit at all; else nvcc on PATH or under /usr/local/cuda.
wheel_nvcc=$("$python" -c "import importlib.util as u, os; s = u.find_spec('nvidia'); print(next((p for d in (s.submodule_search_locations if s else []) for p in [os.path.join(d, 'cu13', 'bin', 'nvcc')] if os.path.isfile(p)), ''))" 2>/dev/null || true)
from_wheels=${LIBRA_CUDA_FROM_WHEELS:-AUTO}
if ! command -v nvcc > /dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    [ -x "$d/nvcc" ] && export PATH=$d:$PATH && break
  done
fi
if [ "$from_wheels" = AUTO ] && [ -z "${CUDACXX:-}" ] && ! command -v nvcc > /dev/null &&
   [ -n "$wheel_nvcc" ]; then
  from_wheels=ON
fi
if [ "$from_wheels" = ON ]; then
  export CUDACXX=$wheel_nvcc  # empty: no wheel (the build step then fails, saying so)
else
  export CUDACXX=${CUDACXX:-$(command -v nvcc || true)}
fi
cd "$work" || exit 1  # never the repository: `python -c` would import its source tree

# --- 1. Environment ------------------------------------------------------------
# shellcheck disable=SC2317  # run through `bash -c` by step
environment() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "dry run: $dry_run; budget ${budget}s"
  echo "repo: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  nvidia-smi topo -m 2>&1 | head -20 || true
  "${CUDACXX:-nvcc}" --version 2>&1 | tail -2
  cmake --version 2>&1 | head -1
  ninja --version 2>&1
  "$python" -c "import sys, jax, jaxlib; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)" 2>&1
  "$python" -c "import jax; print('devices', jax.devices())" 2>&1 | tail -1
}
export dry_run budget repo python CUDACXX
export -f environment
step env 30 bash -c environment
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
versions=$(grep -m1 '^python .* jax ' "$log" || echo 'no jax')
note env INFO "${gpu:-no GPU}; $versions"
if [ -z "$CUDACXX" ]; then
  note nvcc FAIL "nvcc not found (LIBRA_CUDA_FROM_WHEELS=$from_wheels)"
  exit 1
fi

# --- 2. One build: the Python extension and the harness (cpp/tools/harness.cc) ---
site=$work/site
build=$work/build
rm -rf "$site"
step build 200 "$python" -m pip install --no-deps --no-build-isolation --no-index --no-compile \
  -q --target "$site" -C build-dir="$build" -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$arch" \
  -C cmake.define.LIBRA_BUILD_CUDA_HARNESS=ON -C cmake.define.LIBRA_CUDA_FROM_WHEELS="$from_wheels" \
  "$repo"
rc=$?
harness=$build/libra_cuda_harness
if [ $rc -eq 0 ] && [ -x "$harness" ]; then note build PASS "extension + harness (sm_$arch) at ${SECONDS}s"
elif [ $rc -ne 125 ]; then note build FAIL "rc $rc (see log.txt)"; fi

# The built package, not the source tree: run from $work, and say where it came from.
python_ok=0
if [ $rc -eq 0 ]; then
  PYTHONPATH=$site step import 60 "$python" -c "
import libra_jax, sys
from libra_jax import _ffi
where = libra_jax.__file__
assert where.startswith('$site/'), f'imported {where}, not the build in $site'
assert _ffi.HAS_CUDA, 'built without CUDA'
compiler = libra_jax.build_info()['cuda_compiler']
if '$from_wheels' == 'ON':  # the wheel's nvcc, not a system toolkit CMake could also find
    assert compiler == '$CUDACXX', f'compiled with {compiler}, not the wheel\'s $CUDACXX'
print('libra_jax from', where, 'compiled with', compiler)"
  rc=$?
  if [ $rc -eq 0 ]; then
    note import PASS "libra_jax with CUDA from the build, nvcc $([ "$from_wheels" = ON ] && echo "from the wheel: ")$CUDACXX"
    python_ok=1
  elif [ $rc -ne 125 ]; then note import FAIL "rc $rc (see log.txt)"; fi
fi

# --- 3. Host-side checks ---------------------------------------------------------
if [ -x "$harness" ]; then
  step selftest 30 "$harness" selftest
  rc=$?
  if [ $rc -eq 0 ]; then note selftest PASS "harness host-side checks"
  elif [ $rc -ne 125 ]; then note selftest FAIL "rc $rc (see log.txt)"; fi
fi

# --- 4. Tests (on a GPU: the kernels too; anywhere: the cuda lowering) ------------
# Small staging (1 MiB) so that the tests' larger buffers take several rounds.
if [ "$python_ok" = 1 ]; then
  PYTHONPATH=$site LIBRA_JAX_CUDA=p2p LIBRA_JAX_CUDA_STAGING_MIB=1 \
    XLA_PYTHON_CLIENT_PREALLOCATE=false step pytest 150 "$python" -m pytest -q \
    -p no:cacheprovider -rs --rootdir "$repo" "$repo/tests/test_cuda.py" \
    "$repo/tests/test_platform_matrix.py"
  rc=$?
  counts=$(tail -5 "$log" | grep -Eo '[0-9]+ (passed|failed|skipped|errors?)' | paste -sd, -)
  if [ $rc -eq 0 ]; then note pytest PASS "test_cuda, test_platform_matrix: ${counts:-?}"
  elif [ $rc -ne 125 ]; then note pytest FAIL "rc $rc: ${counts:-?}"; fi
fi

# --- 5. On the GPU ------------------------------------------------------------------
if [ "$dry_run" = 0 ] && [ -x "$harness" ]; then
  step check 90 "$harness" check --ranks "$ranks" --csv "$csv"
  rc=$?
  pass=$(grep -c '^check,.*,PASS,' "$csv")
  fail=$(grep -c '^check,.*,FAIL,' "$csv")
  skip=$(grep -c '^check,.*,SKIP,' "$csv")
  if [ $rc -eq 0 ]; then note check PASS "$pass passed, $skip skipped (reasons in harness.csv)"
  elif [ $rc -ne 125 ]; then note check FAIL "rc $rc: $pass passed, $fail failed, $skip skipped"; fi

  step contend 60 "$harness" contend --ranks 8 --bytes 64M --csv "$csv"
  rc=$?
  rows=$(grep -c '^contend,' "$csv")
  if [ $rc -eq 0 ]; then note contend PASS "$rows contention points"
  elif [ $rc -ne 125 ]; then note contend FAIL "rc $rc after $rows contention points"; fi
  if [ "$python_ok" = 1 ] && [ "$rows" -gt 0 ]; then
    PYTHONPATH=$site step profile 30 "$python" "$repo/benchmarks/gpu_profile.py" "$csv" \
      --gpu "$gpu" --out "$out/h200-virtual-ranks.json"
    rc=$?
    if [ $rc -eq 0 ]; then note profile PASS "h200-virtual-ranks.json (proxy curves; h200.json unchanged)"
    elif [ $rc -ne 125 ]; then note profile FAIL "rc $rc (see log.txt)"; fi
  fi

  if [ "$python_ok" = 1 ]; then
    PYTHONPATH=$site LIBRA_JAX_CUDA=p2p XLA_PYTHON_CLIENT_PREALLOCATE=false \
      step overlap 120 "$python" "$repo/benchmarks/gpu_overlap.py" --out "$out"
    rc=$?
    if [ $rc -eq 0 ]; then note overlap PASS "$(grep -c '^| [a-z]' "$out/overlap.md" 2>/dev/null) rows"
    elif [ $rc -ne 125 ]; then note overlap FAIL "rc $rc (see log.txt)"; fi

    # Whether jaxlib's command buffers capture custom calls at all, and that libra's P2P
    # call (not command-buffer compatible) stays out of them.
    PYTHONPATH=$site step cmdbuf 45 "$python" "$repo/benchmarks/gpu_overlap.py" --command-buffers
    rc=$?
    grep '^cmdbuf-' "$log" | tail -2 | while read -r what result detail; do
      note "$what" "$result" "$detail"
    done
    [ $rc -ne 0 ] && [ $rc -ne 125 ] && note cmdbuf FAIL "rc $rc (see log.txt)"

    # Both routes share the step's time (each at most half of what is left when it starts),
    # and each bucket timing is written as it comes: a cut-short run still leaves them.
    nccl_budget=$(( $(left) - reserve - 10 ))
    [ "$nccl_budget" -gt 140 ] && nccl_budget=140
    PYTHONPATH=$site step nccl 150 "$python" "$repo/benchmarks/gpu_nccl_check.py" \
      --budget-s "$nccl_budget" --timeout-s 90
    rc=$?
    grep '^nccl-' "$log" | tail -8 | while read -r what result detail; do
      note "$what" "$result" "$detail"
    done
    [ $rc -ne 0 ] && [ $rc -ne 125 ] && note nccl FAIL "rc $rc (see log.txt)"
  fi

  # The grid is capped: 2 and 8 ranks, 64 KiB .. $max_bytes, blocks 1..64 in powers of 2.
  bench_budget=$(( $(left) - reserve - 15 ))
  if [ "$bench_budget" -gt 10 ]; then
    step bench $((bench_budget + 10)) "$harness" bench --ranks 2,8 --min-bytes 64K \
      --max-bytes "$max_bytes" --blocks 1,2,4,8,16,32,64 --budget-s "$bench_budget" --csv "$csv"
    rc=$?
    rows=$(grep -c '^bench,' "$csv")
    members=$(grep -c '^bench_members,' "$csv")
    if [ $rc -eq 0 ]; then
      note bench PASS "$rows timings, $members of 8 members against one buffer, in a ${bench_budget}s budget"
    elif [ $rc -ne 125 ]; then note bench FAIL "rc $rc after $rows timings"; fi
  else
    note bench SKIP "budget: $(left)s of ${budget}s left"
  fi
elif [ "$dry_run" = 1 ]; then
  note check SKIP "dry run"
  note contend SKIP "dry run"
  note cmdbuf SKIP "dry run (compiles for a GPU)"
  if [ "$python_ok" = 1 ]; then
    PYTHONPATH=$site step overlap 90 "$python" "$repo/benchmarks/gpu_overlap.py" --lower-only
    rc=$?
    if [ $rc -eq 0 ]; then note overlap PASS "dry run: lowered for cuda (--lower-only)"
    elif [ $rc -ne 125 ]; then note overlap FAIL "rc $rc (see log.txt)"; fi
    PYTHONPATH=$site step nccl 60 "$python" "$repo/benchmarks/gpu_nccl_check.py" --plan
    rc=$?
    if [ $rc -eq 0 ]; then note nccl PASS "dry run: $(grep '^nccl-version' "$log" | tail -1)"
    elif [ $rc -ne 125 ]; then note nccl FAIL "rc $rc (see log.txt)"; fi
  fi
  # The budget's enforcement: a step over its timeout is killed at the timeout.
  began=$SECONDS
  step budget-probe "$min_step" sleep 60
  rc=$?
  took=$((SECONDS - began))
  if [ $rc -eq 124 ] && [ "$took" -le $((min_step + 2)) ]; then
    note budget PASS "a step over its ${min_step}s timeout ended after ${took}s"
  elif [ $rc -ne 125 ]; then note budget FAIL "rc $rc after ${took}s (timeout ${min_step}s)"; fi
  note bench SKIP "dry run (stand-in rows exercise the table)"
  printf 'bench,2,oneshot,65536,1,1,9.50,6.90,3\nbench,2,oneshot,65536,8,8,5.00,13.11,3\n' \
    >> "$csv"
  gpu="DRY RUN (stand-in numbers, not measured)"
fi

# --- 6. The table, appended to the summary ---------------------------------------------
{
  echo
  "$python" - "$csv" "${gpu:-?}" <<'EOF' 2>&1 || true
import collections, csv, sys
src, gpu = sys.argv[1:3]
rows = [r for r in csv.reader(open(src)) if r and r[0] == "bench" and len(r) > 6 and r[6]]
if not rows:
    print("no timings"); sys.exit()
t = collections.defaultdict(dict)
blocks = sorted({int(r[4]) for r in rows})
for r in rows:
    t[(int(r[1]), r[2], int(r[3]))][int(r[4])] = float(r[6])
def size(b):
    return f"{b >> 30} GiB" if b >= 1 << 30 else f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
print(f"libra CUDA all-reduce: median µs per call, virtual ranks on one {gpu}.")
print("All ranks share one GPU's memory: this times the kernels and the block count, not")
print("NVLink. Bold: the fastest block count of the row.\n")
print("| ranks | algorithm | bytes/rank | " + " | ".join(f"{b} blk" for b in blocks) + " |")
print("|" + "---|" * (3 + len(blocks)))
for k in sorted(t):
    best = min(t[k].values())
    cells = [("**%.1f**" if t[k].get(b) == best else "%.1f") % t[k][b] if b in t[k] else "-"
             for b in blocks]
    print(f"| {k[0]} | {k[1]} | {size(k[2])} | " + " | ".join(cells) + " |")
EOF
} >> "$summary"

echo
echo "=== libra_jax GPU check (${SECONDS}s of ${budget}s) ==="
cat "$summary"
exit $status

#!/usr/bin/env bash
# The GPU check of libra_jax's CUDA all-reduce, in one script (< 5 minutes).
#
#   bash benchmarks/gpu_check.sh            # on a GPU machine (the `device` tool)
#   bash benchmarks/gpu_check.sh --dry-run  # anywhere with nvcc: build, host-side checks
#
# Builds the project there (no network: nvcc, CMake, ninja, nanobind,
# scikit-build-core and jax with its CUDA plugin must be installed; set PYTHON
# if `python3` is not the one with jax), runs the GPU tests (tests/test_cuda.py)
# and the harness (N = 2, 4, 8 virtual ranks on one GPU: correctness against a
# float64 reference, then the contention curves: a GEMM's and a triad's slowdown
# beside one rank's share of an 8-rank all-reduce vs its blocks, and that
# share's own slowdown; then time vs bytes x blocks), writing results under $OUT
# as they come (default /tmp/libra_gpu_check/out):
#   check.csv, contend.csv, bench.csv   harness results
#   h200.json              the h200 profile fitted to contend.csv (gpu_profile.py)
#   overlap.md             sync vs stream-annotated vs start/done beside compute,
#                          and optimize(overlap="sync" vs "start-done") on an MLP
#                          step: time, bitwise equality, GEMMs XLA schedules
#                          between each start and its done (gpu_overlap.py)
#   table.md               the time-vs-blocks table
#   summary.txt            one line per step
#   logs.tar.gz            environment, build, pytest and harness logs
# and prints a short table last. Exit status: 0 if every step passed.
#
# Environment: PYTHON, OUT, GPU_CHECK_BUDGET_S (total seconds, default 280),
# GPU_CHECK_MAX_BYTES (largest size timed, default 1G), GPU_CHECK_RANKS
# (default 2,4,8), CUDA_ARCH (default 90: the H200).
set -uo pipefail

dry_run=0
case "${1:-}" in
  --dry-run) dry_run=1 ;;
  "") ;;
  -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/libra_gpu_check/out}
logs=$out/logs
budget=${GPU_CHECK_BUDGET_S:-280}
max_bytes=${GPU_CHECK_MAX_BYTES:-1G}
ranks=${GPU_CHECK_RANKS:-2,4,8}
arch=${CUDA_ARCH:-90}
python=${PYTHON:-python3}
work=${GPU_CHECK_WORK:-/tmp/libra_gpu_check}
mkdir -p "$out" "$logs" "$work"
summary=$out/summary.txt
: > "$summary"
status=0

note() {  # note STEP RESULT DETAIL: one line in summary.txt (and on stdout, as it comes)
  printf '%-14s %-5s %s\n' "$1" "$2" "$3" | tee -a "$summary"
  [ "$2" = FAIL ] && status=1
  return 0
}
left() { echo $((budget - SECONDS)); }

# Where nvcc lives when it is not on PATH.
if ! command -v nvcc > /dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    [ -x "$d/nvcc" ] && export PATH=$d:$PATH && break
  done
fi
export CUDACXX=${CUDACXX:-$(command -v nvcc || true)}

# --- 1. Environment ------------------------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "dry run: $dry_run"
  echo "repo: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  nvidia-smi topo -m 2>&1 | head -20 || true
  "${CUDACXX:-nvcc}" --version 2>&1 | tail -2
  cmake --version 2>&1 | head -1
  ninja --version 2>&1
  "$python" -c "import sys, jax, jaxlib; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)" 2>&1
  "$python" -c "import jax; print('devices', jax.devices())" 2>&1 | tail -1
} > "$logs/env.txt" 2>&1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
note env INFO "${gpu:-no GPU}; $(grep -m1 '^python' "$logs/env.txt" || echo 'no jax')"
if [ -z "$CUDACXX" ]; then
  note nvcc FAIL "nvcc not found"
  exit 1
fi

# --- 2. Build: the harness (CMake) and the Python extension (pip) ------------
harness_dir=$work/harness
if cmake -S "$repo" -B "$harness_dir" -G Ninja -DLIBRA_BUILD_PYTHON=OFF \
     -DLIBRA_BUILD_CUDA_HARNESS=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
     > "$logs/build.log" 2>&1 &&
   cmake --build "$harness_dir" --target libra_cuda_harness >> "$logs/build.log" 2>&1; then
  note build-harness PASS "$harness_dir/libra_cuda_harness (sm_$arch) at ${SECONDS}s"
else
  note build-harness FAIL "see logs/build.log"
fi
harness=$harness_dir/libra_cuda_harness

site=$work/site
rm -rf "$site"
if "$python" -m pip install --no-deps --no-build-isolation --no-index --no-compile -q \
     --target "$site" -C build-dir="$work/py-build" \
     -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$arch" "$repo" >> "$logs/build.log" 2>&1 &&
   PYTHONPATH=$site "$python" -c \
     "from libra_jax import _ffi; assert _ffi.HAS_CUDA, 'built without CUDA'" \
     >> "$logs/build.log" 2>&1; then
  note build-python PASS "libra_jax with CUDA at ${SECONDS}s"
  python_ok=1
else
  note build-python FAIL "see logs/build.log"
  python_ok=0
fi

# --- 3. Host-side harness checks ----------------------------------------------
if [ -x "$harness" ]; then
  if "$harness" selftest > "$logs/harness.log" 2>&1; then
    note selftest PASS "harness host-side checks"
  else
    note selftest FAIL "see logs/harness.log"
  fi
fi

# --- 4. Tests -----------------------------------------------------------------
# Small staging (1 MiB) so that the tests' larger buffers take several rounds.
if [ "$python_ok" = 1 ]; then
  (cd "$work" && PYTHONPATH=$site LIBRA_JAX_CUDA_STAGING_MIB=1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
     timeout 150 "$python" -m pytest -q -p no:cacheprovider -rs "$repo/tests/test_cuda.py") \
     > "$logs/pytest.log" 2>&1
  rc=$?
  counts=$(grep -Eo '[0-9]+ (passed|failed|skipped|errors?)' "$logs/pytest.log" | paste -sd, -)
  if [ $rc -eq 0 ]; then note pytest PASS "tests/test_cuda.py: ${counts:-?}"
  else note pytest FAIL "tests/test_cuda.py (rc $rc): ${counts:-?}"; fi
fi

# --- 5. Harness on the GPU -----------------------------------------------------
if [ "$dry_run" = 0 ] && [ -x "$harness" ]; then
  timeout 90 "$harness" check --ranks "$ranks" --csv "$out/check.csv" >> "$logs/harness.log" 2>&1
  rc=$?
  pass=$(grep -c ',PASS,' "$out/check.csv" 2>/dev/null)
  fail=$(grep -c ',FAIL,' "$out/check.csv" 2>/dev/null)
  skip=$(grep -c ',SKIP,' "$out/check.csv" 2>/dev/null)
  if [ $rc -eq 0 ]; then note check PASS "$pass passed, $skip skipped (not co-resident)"
  else note check FAIL "rc $rc: $pass passed, $fail failed, $skip skipped"; fi

  timeout 60 "$harness" contend --ranks 8 --bytes 64M --csv "$out/contend.csv" \
    >> "$logs/harness.log" 2>&1
  rc=$?
  rows=$(grep -c '^contend,' "$out/contend.csv" 2>/dev/null)
  if [ $rc -eq 0 ]; then note contend PASS "$rows contention points"
  else note contend FAIL "rc $rc after $rows contention points"; fi
  if [ "$python_ok" = 1 ] && [ "${rows:-0}" -gt 0 ]; then
    if PYTHONPATH=$site "$python" "$repo/benchmarks/gpu_profile.py" "$out/contend.csv" \
         --gpu "$gpu" --out "$out/h200.json" 2>> "$logs/harness.log"; then
      note profile PASS "h200.json: contention parameters fitted (copy to libra_jax/profiles/)"
    else note profile FAIL "see logs/harness.log"; fi
  fi

  if [ "$python_ok" = 1 ]; then
    (cd "$work" && PYTHONPATH=$site XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 \
       "$python" "$repo/benchmarks/gpu_overlap.py" --out "$out") >> "$logs/overlap.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then note overlap PASS "$(grep -c '^| [a-z]' "$out/overlap.md") rows"
    else note overlap FAIL "rc $rc (see logs/overlap.log)"; fi
  fi

  bench_budget=$(( $(left) - 25 ))
  if [ "$bench_budget" -gt 10 ]; then
    timeout $((bench_budget + 20)) "$harness" bench --ranks "$ranks" --max-bytes "$max_bytes" \
      --budget-s "$bench_budget" --csv "$out/bench.csv" >> "$logs/harness.log" 2>&1
    rc=$?
    rows=$(grep -c '^bench,' "$out/bench.csv" 2>/dev/null)
    if [ $rc -eq 0 ]; then note bench PASS "$rows timings in ${bench_budget}s budget"
    else note bench FAIL "rc $rc after $rows timings"; fi
  else
    note bench SKIP "no time left"
  fi
elif [ "$dry_run" = 1 ]; then
  note check SKIP "dry run"
  note contend SKIP "dry run"
  note overlap SKIP "dry run"
  note bench SKIP "dry run"
  # Stand-in timings, to exercise the table step below.
  gpu="DRY RUN (stand-in numbers, not measured)"
  printf 'bench_header,ranks,algorithm,bytes,blocks,effective_blocks,median_us,algbw_GBps,iters\n' \
    > "$out/bench.csv"
  printf 'bench,2,oneshot,65536,1,1,9.50,6.90,3\nbench,2,oneshot,65536,8,8,5.00,13.11,3\n' \
    >> "$out/bench.csv"
fi

# --- 6. Table, logs -------------------------------------------------------------
"$python" - "$out/bench.csv" "$out/table.md" "${gpu:-?}" <<'EOF' > "$work/table.txt" 2>&1 || true
import collections, csv, sys
src, dst, gpu = sys.argv[1:4]
rows = [r for r in csv.reader(open(src)) if r and r[0] == "bench" and r[6]]
if not rows:
    print("no timings"); sys.exit()
t = collections.defaultdict(dict)
blocks = sorted({int(r[4]) for r in rows})
for r in rows:
    t[(int(r[1]), r[2], int(r[3]))][int(r[4])] = float(r[6])
def size(b):
    return f"{b >> 30} GiB" if b >= 1 << 30 else f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
def table(keys):
    head = "| ranks | algorithm | bytes/rank | " + " | ".join(f"{b} blk" for b in blocks) + " |"
    lines = [head, "|" + "---|" * (3 + len(blocks))]
    for k in keys:
        best = min(t[k].values())
        cells = [("**%.1f**" if t[k].get(b) == best else "%.1f") % t[k][b] if b in t[k] else "-"
                 for b in blocks]
        lines.append(f"| {k[0]} | {k[1]} | {size(k[2])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
keys = sorted(t)
with open(dst, "w") as f:
    f.write(f"# libra CUDA all-reduce: median µs per call, virtual ranks on one {gpu}\n\n"
            "All ranks share one GPU's memory, so this times the kernels and the\n"
            "block count, not NVLink. Bold: fastest block count of the row.\n\n")
    f.write(table(keys) + "\n")
short = [k for k in keys if k[0] == max(k[0] for k in keys)]
print(f"median µs per all-reduce, {short[0][0]} virtual ranks (full table: table.md)")
print(table(short))
EOF

rm -f "$out/logs.tar.gz"
tar -czf "$work/logs.tar.gz" -C "$out" logs && mv "$work/logs.tar.gz" "$out/logs.tar.gz" &&
  rm -rf "$logs"

echo
echo "=== libra_jax GPU check (${SECONDS}s) ==="
cat "$summary"
echo
cat "$work/table.txt"
exit $status

#!/usr/bin/env bash
# Smoke test of gobrrr's torchrun commands on one host of 2-4 GPUs, in under 3 minutes:
#   calibrate --collectives --quick  -> $OUT/coll.json (a copy of the H100 calibration with the
#                                       collectives measured here; the user's file untouched)
#   profile gpt2 --parallel ddp|fsdp --compare --json -> $OUT/profile_{ddp,fsdp}.json
# Each step's stderr is kept in $OUT/*.log; the script ends non-zero if any step failed, or
# printed anything but one JSON object.
#
#   OUT=/tmp/out bash benchmarks/multigpu/torchrun_cli.sh            # every GPU of the host
#   OUT=/tmp/out NGPU=2 bash benchmarks/multigpu/torchrun_cli.sh
#   DEVICE=cpu NGPU=2 BATCH=1 SEQ=64 STEPS=1 WARMUP=0 bash benchmarks/multigpu/torchrun_cli.sh
#                                    # the same on CPU ranks (gloo), no calibration: a dry run
set -uo pipefail
cd "$(dirname "$0")/../.."

DEVICE=${DEVICE:-cuda}
NGPU=${NGPU:-$( [ "$DEVICE" = cpu ] && echo 2 || nvidia-smi -L | wc -l )}
OUT=${OUT:-/tmp/gobrrr_torchrun_cli}
MODEL=${MODEL:-gpt2} BATCH=${BATCH:-2} SEQ=${SEQ:-1024} STEPS=${STEPS:-10} WARMUP=${WARMUP:-3}
PYTHON=${PYTHON:-python}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
mkdir -p "$OUT"
failed=0

run() {  # run NAME SECONDS ARGS...: torchrun on $NGPU ranks, stdout to $OUT/NAME.json
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$PYTHON" -m torch.distributed.run --nproc-per-node "$NGPU" \
    --master-port "$((29500 + RANDOM % 1000))" -m gobrrr "$@" \
    >"$OUT/$name.json" 2>"$OUT/$name.log"
  local rc=$?
  if [ $rc -eq 0 ] && "$PYTHON" -c 'import json,sys; json.load(open(sys.argv[1]))' "$OUT/$name.json"; then
    echo "$name: ok ($((SECONDS - t0)) s)"
  else
    echo "$name: FAILED rc=$rc ($((SECONDS - t0)) s); its first error:"
    grep -m1 "gobrrr: error" "$OUT/$name.log" || tail -n 5 "$OUT/$name.log"
    failed=1
  fi
}

if [ "$DEVICE" = cpu ]; then
  echo "calibrate --collectives: skipped on CPU ranks (it measures NCCL between GPUs)"
  where=(--device cpu --gpu h100)
else
  run coll_stdout 120 calibrate --collectives --quick --output "$OUT/coll.json" --json
  where=()
fi
for parallel in ddp fsdp; do
  run "profile_$parallel" 150 profile "$MODEL" --batch "$BATCH" --seq "$SEQ" \
    --steps "$STEPS" --warmup "$WARMUP" --parallel "$parallel" --compare --json "${where[@]}"
done
"$PYTHON" - "$OUT" <<'EOF'
import json, pathlib, sys

for f in sorted(pathlib.Path(sys.argv[1]).glob("profile_*.json")):
    try:
        r = json.loads(f.read_text())
        m, p, e = r["measured"], r.get("predicted", {}), r.get("error", {})
    except (ValueError, KeyError):
        continue
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"
    ms = lambda s: "-" if s is None else f"{s * 1e3:.1f} ms"
    pct = lambda x: "-" if x is None else f"{x:+.1%}"
    ex = m.get("comm_exposed_s") or {}
    print(
        f"{r['parallel']} x{r['world']}: step {ms(m['step_s'])} (pred {ms(p.get('step_s'))}, "
        f"{pct(e.get('step_s'))}), allocated {gib(m['peak_allocated'])} "
        f"(pred {gib(p.get('peak_allocated'))}, {pct(e.get('peak_allocated'))}), exposed comm "
        f"min {ms(ex.get('min'))} (pred {ms(p.get('comm_exposed_s'))})"
    )
EOF
exit $failed

#!/usr/bin/env bash
# The data loader application (apps/loader) on a GPU machine, from the repository root after
# scripts/gpu/build: makes the JPEG data set in /tmp, measures the decode's GPU cost per image, then runs
# ResNet-50 and ResNet-18 fed by gpipe, by the in-process GPU decode, by a torch DataLoader and
# by synthetic tensors (the ceiling), without MPS and then with MPS. Results under $OUT:
# loader.jsonl (one JSON line per run), summary.txt (the table and the issue's targets),
# profile.txt (torch.profiler tables), logs.txt (every child's stderr), loader.svg (the chart).
#
#   bash apps/loader/gpu.sh            # the full run, one GPU, under 9 minutes on an H100
#   bash apps/loader/gpu.sh quick      # a few steps of every run, to check that all work
#   bash apps/loader/gpu.sh loader     # gpipe.torch.Loader against the training ceiling: ResNet-50
#                                      # and ResNet-18 on 1, 2 and every GPU (DDP), MPS off, then on
#   HOST_DECODE=1 bash apps/loader/gpu.sh loader   # the same, decoding on the CPU (host_decode.py)
#   bash apps/loader/gpu.sh ddp        # the 2-GPU machine: gpipe on 1 and 2 GPUs (DDP)
#   bash apps/loader/gpu.sh ddp quick
#   MPS=on SM_PERCENT=25 bash apps/loader/gpu.sh ddp   # MPS only, producers at 25% of SMs
#   bash apps/loader/gpu.sh decoders   # one GPU, MPS: 1, 2, 3 decode processes per GPU
#   bash apps/loader/gpu.sh scaling    # which stage caps the node: read, decode, pipeline
#                                             # in 1, 2, 4 processes, from the folder and its pack
#   PACK=1 bash apps/loader/gpu.sh decoders   # the same runs reading the pack
#   PACK=1 SIDE_STREAM=1 bash apps/loader/gpu.sh decoders   # producers off the default stream
#
# scaling writes scaling.jsonl (apps/loader/scaling.py; PROCS, SECONDS_PER_POINT, STAGES and
# MPS=on|off, default on, change it; SCALING_ARGS="--side-stream --profile $OUT/prof" adds
# the probe's own options). PACK=1 packs the data set into one file
# (pack_dataset.py) and gives every run that file as --data; its labels end in -pack.
# DECODERS=K (default 1) gives every gpipe run K decode processes per GPU (`run_all.py
# --decoders`), labelled -dK; the decoders mode sweeps DECODER_COUNTS (default "1 2 3") over
# MODELS (default resnet18) and measures the DataLoader reference (no MPS) beside them.
#
# Every child runs under a hard limit (timeout -k 5 N setsid ...); run_all.py also bounds each
# run and skips what would overrun its budget.
set -u
. "$(dirname "$0")/../../scripts/gpu/lib.sh"
O=${OUT:-/tmp/o}; mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mode=${1:-full}; speed=${2:-}
[ "$mode" = quick ] && { mode=full; speed=quick; }
DATA=/tmp/loader-data
if [ "$speed" = quick ]; then COUNT=3072; Q=--quick; else COUNT=20000; Q=; fi


nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch as t, torchvision as v; print('torch', t.__version__, v.__version__, t.cuda.device_count(), 'GPUs')"
echo "== data set: $COUNT images in $DATA"
limit 100 python3 apps/loader/make_dataset.py "$DATA" --count "$COUNT" 2>&1 | tail -3
SRC=$DATA; P=
if [ -n "${PACK:-}" ] || [ "$mode" = scaling ]; then
  limit 120 python3 apps/loader/pack_dataset.py "$DATA"
  [ -n "${PACK:-}" ] && { SRC=$DATA.pack; P=-pack; }
fi
run() { limit "$1" python3 apps/loader/run_all.py --data "$SRC" --out "$O" --no-summary $Q "${@:2}"; }
K=${DECODERS:-1}; D=(--decoders "$K"); S=$P; [ "$K" -gt 1 ] && S=-d$K$P
# SM_PERCENT=P (MPS runs only): each producer may use P% of the SMs, labelled -smP.
MD=(); MS=; [ -n "${SM_PERCENT:-}" ] && { MD=(--producer-sm-percent "$SM_PERCENT"); MS=-sm$SM_PERCENT; }
# PROFILE=N (ddp): torch.profiler over N extra steps of the DDP runs, rank 0 (OUT/profile.txt).
[ -n "${PROFILE:-}" ] && MD+=(--profile "$PROFILE")
# SIDE_STREAM=1: producers augment and publish on a stream of their own (labels end in -side).
[ -n "${SIDE_STREAM:-}" ] && { MD+=(--producer-side-stream); P=$P-side; S=$S-side; }
if [ "$mode" = scaling ]; then
  [ "${MPS:-on}" = on ] && mps_on
  echo "== scaling: each stage in ${PROCS:-1,2,4} processes over every GPU (MPS ${MPS:-on})"
  limit "${SCALING_S:-420}" python3 apps/loader/scaling.py "$DATA" "$DATA.pack" --procs "${PROCS:-1,2,4}" \
    --stages "${STAGES:-read,decode,pipeline}" --seconds "${SECONDS_PER_POINT:-5}" --json-out "$O/scaling.jsonl" \
    ${SCALING_ARGS:-} > /dev/null
  [ "${MPS:-on}" = on ] && mps_off
  exit 0
elif [ "$mode" = loader ]; then
  # WORLDS: the GPU counts to run (default 1, 2 and every GPU); ONE_S and DDP_S: seconds for
  # the one-GPU run and for each DDP run of each MPS setting.
  # HOST_DECODE=1: the workers decode on the CPU, the trainer augments on its GPU
  # (loader_lib.py --host-decode), auto up to MAX_WORKERS (default the loader's); labels end in -host.
  # MIXED=N (with MPS): the first N workers decode on the GPU, the rest on the CPU
  # (loader_lib.py --mixed); labels end in -mixedN.
  # LOADER_SETTLE=N: at most N steps for auto to settle before the timed ones (default 600).
  HD=(); H=
  [ -n "${HOST_DECODE:-}" ] && { HD=(--loader-host-decode --loader-max-workers "${MAX_WORKERS:-0}"); H=-host; }
  [ -n "${MIXED:-}" ] && { HD+=(--loader-mixed "$MIXED"); H=-mixed$MIXED; }
  [ -n "${LOADER_SETTLE:-}" ] && HD+=(--loader-settle "$LOADER_SETTLE")
  G=$(gpu_count); worlds=()
  for w in ${WORLDS:-1 2 $G}; do
    [ "$w" -le "$G" ] && [[ " ${worlds[*]} " != *" $w "* ]] && worlds+=("$w")
  done
  for m in ${MPS_SETTINGS:-off on}; do
    [ "$m" = on ] && mps_on
    for w in "${worlds[@]}"; do
      s=${DDP_S:-130}; [ "$w" = 1 ] && s=${ONE_S:-130}
      echo "== gpipe.torch.Loader, $w GPU(s), MPS $m${HOST_DECODE:+, decode on the host}"
      run "$s" --label "lib-$m$P$H" --world-size "$w" --ddp-only --configs loader,ceiling \
        --models "${MODELS:-resnet50,resnet18}" --budget $(( s - 10 )) --run-limit $(( s - 40 )) "${HD[@]}"
    done
    [ "$m" = on ] && mps_off
  done
elif [ "$mode" = ddp ]; then
  if [ "${MPS:-both}" != on ]; then
    echo "== 2 GPUs, no MPS, $K decode process(es) per GPU"
    run 170 --world-size 2 --models resnet50 --configs gpipe,ceiling --label nomps$S "${D[@]}" "${MD[@]}" \
      --probe --budget 160
  fi
  if [ "${MPS:-both}" != off ]; then
    echo "== 2 GPUs, MPS, $K decode process(es) per GPU"
    mps_on; run 150 --world-size 2 --models resnet50 --configs gpipe,ceiling --label mps$S$MS "${D[@]}" \
      "${MD[@]}" --budget 140; mps_off
  fi
elif [ "$mode" = decoders ]; then
  echo "== the DataLoader reference (CPU-bound: no MPS)"
  run 120 --label nomps$P --models "${MODELS:-resnet18}" --configs dataloader --budget 110
  mps_on
  for k in ${DECODER_COUNTS:-1 2 3}; do
    echo "== MPS, $k decode process(es) per GPU"
    run 150 --label "mps-d$k$P" --decoders "$k" --models "${MODELS:-resnet18}" --configs gpipe,producer \
      "${MD[@]}" --budget 140
  done
  mps_off
else
  if [ "$speed" = quick ]; then
    echo "== quick, no MPS"
    run 150 --label nomps --probe --models resnet18 --profile 2 --budget 140
    echo "== quick, MPS"
    mps_on; run 90 --label mps --models resnet18 --configs gpipe,producer --budget 80; mps_off
  else
    # One device command each (under 10 minutes): `full` runs both parts in one.
    if [ "$mode" != mps ]; then
      echo "== no MPS"
      run ${NOMPS_S:-420} --label nomps$S "${D[@]}" --probe --profile 3 --budget $(( ${NOMPS_S:-420} - 15 ))
    fi
    if [ "$mode" != nomps ]; then
      echo "== MPS (the DataLoader is CPU-bound: its no-MPS run is the reference)"
      mps_on; run ${MPS_S:-300} --label mps$S "${D[@]}" --configs loader,gpipe,inprocess,ceiling,producer --budget $(( ${MPS_S:-300} - 15 )); mps_off
    fi
  fi
fi
echo "== summary"
limit 10 python3 apps/loader/run_all.py --out "$O" --summary-only > /dev/null
cat "$O/summary.txt"
limit 25 python3 apps/loader/plot.py "$O/loader.jsonl" "$O/loader.svg"

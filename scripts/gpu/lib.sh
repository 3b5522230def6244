# Helpers the GPU scripts share; source it from the repo root: `. scripts/gpu/lib.sh`.

# limit SECONDS COMMAND...: runs COMMAND in its own process group under a hard limit that
# kills the whole group.
limit() { local s=$1; shift; timeout -k 5 "$s" setsid "$@"; }

# bench_into FILE SECONDS TAG ARGS...: one `gpipe bench --backend cuda --json ARGS` report,
# appended to FILE (JSONL) as {"tag": TAG, "report": ...}; its stderr goes to FILE with .err
# for .jsonl. Prints "FAILED: ..." when no report came back.
bench_into() {
  local file=$1 secs=$2 tag=$3
  shift 3
  local line
  line=$(limit "$secs" gpipe bench --backend cuda --json "$@" 2>>"${file%.jsonl}.err" </dev/null |
    python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))' 2>>"${file%.jsonl}.err")
  if [ -n "$line" ]; then
    echo "{\"tag\": \"$tag\", \"report\": $line}" >>"$file"
  else
    echo "FAILED: $tag $*"
  fi
}

# mps_on / mps_off: start and stop the MPS control daemon for this script's processes.
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && sleep 1 && echo "MPS on"
}
mps_off() {
  echo quit | nvidia-cuda-mps-control
  sleep 2
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

#!/usr/bin/env bash
# Shared mode under a consumer that rewrites claim words (issue 36, point 2). Two honest
# verifying consumers, 1 000 batches at 200/s, --detach-after-ms 500, and a third consumer that
# for SECS seconds either writes claim words (MODE=forge; FORGE=0..4 picks one kind of value:
# a claim in another's name, unclaimed, all ones, the departed owner, garbage; unset: all in
# turn) or stays attached doing nothing (MODE=idle, the baseline).
#   GPIPE=target/release/gpipe MODE=forge bash shared_claims.sh
set -u
G=$(realpath "${GPIPE:-target/release/gpipe}"); HERE=$(cd "$(dirname "$0")" && pwd)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT; cd "$W"
timeout 60 "$G" produce --socket "$W/r.sock" --backend host --mode shared --rate 200 --batches 1000 \
  --batch-bytes 1MiB --wait-for-consumers 3 --detach-after-ms 500 > p.out 2>&1 & P=$!
sleep 1
for i in 1 2; do
  timeout 55 "$G" consume --socket "$W/r.sock" --verify --work-us 2000 --seq-log "s$i.log" > "c$i.out" 2>&1 &
done
sleep .3; S=$(date +%s.%N)
timeout 20 python3 "$HERE/a2_ctl.py" "$W/r.sock" "${MODE:-forge}" "${SECS:-3}"
wait
echo "1000 batches at 200/s took $(echo "$(date +%s.%N) - $S" | bc) s"
tail -qn1 c1.out c2.out; grep -v "batches published" p.out
python3 - <<'PY'
import struct, collections
got = [x[0] for f in ("s1.log", "s2.log") for x in struct.iter_unpack("<Q", open(f, "rb").read())]
c = collections.Counter(got)
print(f"delivered {len(got)} times, {len(c)} distinct of 1000; most copies of one batch {max(c.values())}")
PY

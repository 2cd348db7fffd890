#!/usr/bin/env bash
# Convert a big checkpoint on several machines at once: every machine runs this, with its own NODE_RANK.
# Output rank r is written by worker r % (NNODES * 8); worker 0 commits the manifest once all are done.
# Every machine must see SRC and DST at the same path or URL (a shared file system, or object storage).
#
#   NNODES=4 NODE_RANK=0 MASTER=10.0.0.1 bash examples/convert_multinode.sh   # on the first machine
#   NNODES=4 NODE_RANK=1 MASTER=10.0.0.1 bash examples/convert_multinode.sh   # ... and so on
set -euo pipefail
SRC=${SRC:-s3://bucket/run/step-10000}
DST=${DST:-s3://bucket/run/step-10000-ws512}
torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${NPROC:-8}" \
    --rdzv-backend c10d --rdzv-endpoint "${MASTER:-127.0.0.1}:29400" \
    -m shardckpt.cli.main convert "$SRC" "$DST" --world-size "${WORLD_SIZE_OUT:-512}" --quiet

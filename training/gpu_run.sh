#!/usr/bin/env bash
# Fine-tune the shipped default model on one GPU for decoding with kv_share="last", in one command on a machine
# that has PyTorch but no network and no tinyloop build, and that returns only a few files of at most 16 MiB each.
# So the data travel tokenized (data/chat/*.bin, which train.py reads where the text is absent), gguf travels as a
# wheel (to read the shipped file), and the weights come back as float16 in 15 MB pieces.
#
# Before, here:
#   python training/dialogue.py --corpus data/corpus --out data/chat
#   python -c 'import sys, pathlib; sys.path.insert(0, "training"); from train import tokenize
#              [tokenize(pathlib.Path("data/chat", s)) for s in ("train.txt", "heldout.txt")]'   # the .bin files
#   pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0
# There (the two .bin files and .whl travel; nothing else under data/ needs to):
#   OUT=/path/to/results MINUTES=6 training/gpu_run.sh
# (DATA=folder trains on another folder's train.bin / heldout.bin, e.g. the chat data and the plain corpus joined;
# EXITS and EXIT_DISTILL set --exit-weights and --exit-distill, e.g. EXITS=1:0.1,2:0.2,3:0.2,4:0.4,5:0.4,6:0.2,last:1.0
# EXIT_DISTILL=1 to train the early loops toward the last one's answer for adaptive depth.)
# The final weights come back as weights.pt.*, and those of the periodic evaluation nearest the middle of the run as
# mid.pt.* (a fallback, should the held-out figures in train_log.txt turn before the end).
# After, here:
#   cat RESULTS/weights.pt.* > data/gpu-out/model.pt
#   python training/export.py data/gpu-out/model.pt data/gpu-out/raw.tinyloop --max-trained-loops 12 \
#       --generation frequency_penalty=0.5
# then `tinyloop draft-vocab` and the measures in training/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the results go to}"
MINUTES=${MINUTES:-6}
BATCH=${BATCH:-16}
LR=${LR:-3e-4}
SHARE=${SHARE:-0.6}
DATA=${DATA:-data/chat}
EVERY=${EVERY:-1.5}
PASSES=${PASSES:-2}
EXITS=${EXITS:-1:0.1,2:0.2,half:0.15,last:1.0}
EXIT_DISTILL=${EXIT_DISTILL:-0}
RUN=${RUN:-/tmp/gpu-run}
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
mkdir -p "$OUT" "$RUN"
SHIPPED=python/tinyloop/models/default.tinyloop
python3 training/train.py --data "$DATA" --out "$RUN" --init-from "$SHIPPED" --distill-from "$SHIPPED" \
    --minutes "$MINUTES" --batch "$BATCH" --lr "$LR" --loops-min 6 --loops-max 12 \
    --exit-weights "$EXITS" --exit-distill "$EXIT_DISTILL" --kv-share-frac "$SHARE" --kv-share-passes "$PASSES" \
    --eval-every "$EVERY" --keep-checkpoints 2>&1 | tee "$OUT/train_log.txt"
cp "$RUN/log.json" "$OUT/log.json"
MID=$(ls "$RUN"/model.step*.pt 2>/dev/null | sort -V | awk '{a[NR] = $0} END {if (NR) print a[int((NR + 1) / 2)]}')
python3 - "$RUN/model.pt" "$RUN/weights.pt" ${MID:+"$MID" "$RUN/mid.pt"} <<'EOF'
import sys

import torch

for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):
    ckpt = torch.load(src, map_location="cpu")
    state = {k: v.half() if v.is_floating_point() else v for k, v in ckpt["state"].items()}
    torch.save({"cfg": ckpt["cfg"], "state": state, "tokens": ckpt["tokens"]}, dst)
    print(f"{src}: {ckpt['tokens']:,} tokens -> {dst}")
EOF
split -b 15000000 -d "$RUN/weights.pt" "$OUT/weights.pt."
if [ -n "$MID" ]; then split -b 15000000 -d "$RUN/mid.pt" "$OUT/mid.pt."; fi
ls -l "$OUT"

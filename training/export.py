"""Export a trained checkpoint to a `.tinyloop` file and check the file against PyTorch.

    python training/export.py data/run/model.pt python/tinyloop/models/default.tinyloop

Everything is stored as F16 (norms F32): about 29 MB for d = 256, under the 32 MB the package may ship, and exact
enough that `train.py --init-from` can continue training from the shipped file. The check
runs the exported file through the engine and the checkpoint through PyTorch (float32) on held-out text and prints
the largest logit difference at several depths.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from tinyloop.extras import require_or_exit

try:
    import torch
except ModuleNotFoundError:
    require_or_exit("train", "training", "torch")  # one line naming the extra, exit 2
    raise

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import LoopedLM, TrainConfig, file_config


def load(path: Path) -> LoopedLM:
    ckpt = torch.load(path, map_location="cpu")
    model = LoopedLM(TrainConfig(**ckpt["cfg"]))
    model.load_state_dict(ckpt["state"])
    return model.eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--name", default="tinyloop-default")
    ap.add_argument("--weight-type", default="F16")
    ap.add_argument("--embedding-type", default="F16")
    ap.add_argument("--default-loops", type=int, default=8)
    ap.add_argument("--max-trained-loops", type=int, default=10)
    ap.add_argument("--check-text", type=Path, default=Path("data/corpus/heldout.txt"))
    ap.add_argument(
        "--chat-template",
        type=Path,
        default=Path(__file__).resolve().parent / "chat_template.jinja",
        help="the Jinja chat template the file carries (tokenizer.chat_template); 'none' for none",
    )
    ap.add_argument(
        "--generation",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a sampling setting the file recommends (tinyloop.generation.*), e.g. frequency_penalty=0.5; repeatable",
    )
    args = ap.parse_args()

    from tinyloop.modelfile.format import write_model

    model = load(args.checkpoint)
    cfg = file_config(model.cfg, args.default_loops, args.max_trained_loops, args.name)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    template = None if str(args.chat_template) == "none" else args.chat_template.read_text(encoding="utf-8")
    write_model(
        args.out,
        cfg,
        model.export_weights(),
        weight_type=args.weight_type,
        embedding_type=args.embedding_type,
        chat_template=template,
        generation={k: float(v) for k, v in (item.split("=", 1) for item in args.generation)},
    )
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")

    import tinyloop

    engine = tinyloop.Engine(args.out)
    text = args.check_text.read_text()[:4000] if args.check_text.exists() else "In the beginning God created"
    ids = engine.encode(text)[:128]
    for d in (1, 2, 4, 8):
        seq = engine.sequence()
        got = np.frombuffer(seq.feed(ids, d), dtype=np.float32).reshape(len(ids), -1)
        with torch.no_grad():
            want = model.logits(model.hidden_states(torch.tensor([ids]), d, {d})[d])[0].float().numpy()
        diff = np.abs(got - want).max()
        print(
            f"loops {d}: max |logit diff| engine vs PyTorch {diff:.4f} (max |logit| {np.abs(want).max():.1f}), "
            f"argmax agreement {np.mean(got.argmax(1) == want.argmax(1)):.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

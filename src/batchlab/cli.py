"""`batchlab <stage>`: the commands dvc.yaml and people call."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from batchlab import launch, tracking
from batchlab.config import ConfigError, load_config
from batchlab.data import DataError

BAD_INPUT = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchlab", description="batchlab pipeline stages")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file (default params.yaml)")
    parser.add_argument("--out", type=Path, default=None, help="write models/ and reports/ under this folder")
    sub = parser.add_subparsers(dest="stage", required=True)
    sub.add_parser("validate", help="check params.yaml before any stage removes its outputs (dvc.yaml's first stage)")
    sub.add_parser("generate", help="build the train/val/test split under data/prepared")
    sub.add_parser("train", help="train the model (DDP launches itself through torchrun)")
    sub.add_parser("evaluate", help="test-split metrics, confusion matrix, model registration")
    sub.add_parser("export", help="ONNX export plus the onnxruntime parity gate")
    sub.add_parser("sweep", help="train at every sweep.batch_sizes and write the trade-off report")
    return parser


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise tracking.Interrupted(f"signal {signum}")


def run(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    cfg = load_config(args.params)
    if args.stage == "validate":  # runs on every params change: no torch, no mlflow
        from batchlab.validate import validate

        validate(cfg)
        return
    from batchlab import stages

    paths = stages.Paths(out=args.out)
    if args.stage == "generate":
        stages.generate(cfg, paths)
    elif args.stage == "train":
        if launch.is_worker():
            stages.train_worker(cfg, paths)
        else:
            stages.train(cfg, args.params, paths)
    elif args.stage == "evaluate":
        stages.evaluate_stage(cfg, paths)
    elif args.stage == "export":
        stages.export_stage(cfg, paths)
    elif args.stage == "sweep":
        from batchlab import sweep  # scikit-learn and matplotlib: imported by this stage only

        sweep.run_sweep(cfg, paths)


def main(argv: list[str] | None = None) -> int:
    level = os.environ.get("BATCHLAB_LOG", "INFO")
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    for noisy in ("mlflow", "alembic", "urllib3", "git", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        run(sys.argv[1:] if argv is None else argv)
    except (ConfigError, DataError) as err:
        print(f"batchlab: error: {err}", file=sys.stderr)
        return BAD_INPUT
    except (tracking.TrackingUnavailable, launch.LaunchError, RuntimeError, FileNotFoundError) as err:
        print(f"batchlab: error: {err}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, tracking.Interrupted):
        print("batchlab: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

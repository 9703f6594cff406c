"""``gradstats trace``: train a built-in model on built-in data with the tracer attached."""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def _schedule(text: str):
    """'50' -> 50; '0,10,100' -> [0, 10, 100]; 'none' -> None."""
    if text.lower() == "none":
        return None
    if "," in text:
        return [int(s) for s in text.split(",") if s]
    return int(text)


def _models() -> list[str]:
    from gradstats.zoo.models import list_models

    return list_models()


def register(sub: argparse._SubParsersAction) -> None:
    from gradstats.cli import LazyChoices

    p = sub.add_parser("trace", help="train a built-in model and trace its neural gradients into a run",
                       description="Train a built-in model on built-in data with gradstats.trace attached.")
    p.add_argument("--model", default="cnn", metavar="MODEL", choices=LazyChoices(_models),
                   help="built-in model: %(choices)s (default cnn)")
    p.add_argument("--data", default="fashion-mnist",
                   help="fashion-mnist, digits, shakespeare, or a directory of Fashion-MNIST IDX files")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default per optimizer)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    p.add_argument("--every", type=_schedule, default=1, help="statistics period or list of steps (default 1)")
    p.add_argument("--sample-every", type=_schedule, default=50,
                   help="raw-sample period, list of steps, or none (default 50)")
    p.add_argument("--samples", type=int, default=65536, help="values kept per sampled capture")
    p.add_argument("--kinds", default="grad", help="comma list of grad, act, weight, wgrad (default grad)")
    p.add_argument("--layers", default=None, help="glob on module names (default: modules with parameters)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="run directory to write")
    p.add_argument("--resume", action="store_true",
                   help="continue the run at --out after its last committed step")
    p.add_argument("--start-step", type=int, default=None,
                   help="number of the first step recorded (continuing from a checkpoint)")
    p.set_defaults(func=run)


def load_data(name: str, model: str):
    """Training and test data for a built-in model by name (``--data``)."""
    from pathlib import Path

    from gradstats.zoo import data
    from gradstats.zoo.models import TEXT_MODELS

    if model in TEXT_MODELS or name == "shakespeare":
        if model not in TEXT_MODELS:
            raise ValueError("the shakespeare data trains a character model; pass --model "
                             + " or --model ".join(sorted(TEXT_MODELS)))
        ds = data.load_shakespeare()
        return ds, None
    size = 32 if model == "resnet18" else None
    if Path(name).is_dir():
        return (data.load_fashion_mnist(name, split="train", size=size),
                data.load_fashion_mnist(name, split="test", size=size))
    if name not in ("fashion-mnist", "digits", "auto"):
        raise ValueError(f"unknown --data {name!r}: expected fashion-mnist, digits, shakespeare or a "
                         "directory holding Fashion-MNIST IDX files")
    kw = {"size": size} if size else {}
    return data.load_images(name, split="train", **kw), data.load_images(name, split="test", **kw)


def check_args(args: argparse.Namespace) -> None:
    """Reject bad values before any data is loaded or model built."""
    for name in ("steps", "batch_size", "samples"):
        v = getattr(args, name)
        if v is None or v <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
    if args.lr is not None and not args.lr > 0:
        raise ValueError(f"--lr must be a positive number, got {args.lr}")
    if args.start_step is not None and args.start_step < 0:
        raise ValueError(f"--start-step must be a step number >= 0, got {args.start_step}")
    for name in ("every", "sample_every"):
        v = getattr(args, name)
        bad = (isinstance(v, int) and v <= 0) or (isinstance(v, list) and any(s < 0 for s in v))
        if bad:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive period, a comma list of "
                             f"steps >= 0, or none; got {v}")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    from gradstats.tracer import KINDS

    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"--kinds must be a comma list of {', '.join(KINDS)}; got {args.kinds!r}")


def run(args: argparse.Namespace) -> int:
    import gradstats
    from gradstats.zoo.models import build_model
    from gradstats.zoo.training import make_optimizer, train

    check_args(args)
    train_set, test_set = load_data(args.data, args.model)
    log.info("data: %r", train_set)
    kw = {"vocab_size": train_set.vocab_size} if hasattr(train_set, "vocab_size") else {}
    model = build_model(args.model, seed=args.seed, **kw)
    opt = make_optimizer(model, args.optimizer, lr=args.lr)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    with gradstats.trace(model, args.out, layers=args.layers, every=args.every,
                         sample_every=args.sample_every, samples=args.samples, kinds=kinds,
                         optimizer=opt, seed=args.seed, resume=args.resume, start_step=args.start_step):
        result = train(model, train_set, test=test_set, steps=args.steps, batch_size=args.batch_size,
                       optimizer=opt, seed=args.seed)
    acc = "" if result.test_accuracy is None else f", test accuracy {result.test_accuracy:.3f}"
    print(f"traced {args.steps} steps of {args.model} on {getattr(train_set, 'source', args.data)}"
          f" into {args.out} ({result.step_time * 1e3:.0f} ms/step{acc})")
    from gradstats.cli.info import print_info

    print_info(gradstats.open_run(args.out))
    return 0

"""CLI: ``python -m async_rl.demo prepare --output-dir DIR [--seed 0] [--train-size N] [--val-size M]
[--model-size tiny]``."""

import argparse

from async_rl.demo.task import DEFAULT_MODEL_SIZE, DEFAULT_TRAIN_SIZE, DEFAULT_VAL_SIZE, MODEL_SIZES, prepare


def main(argv=None) -> None:
    """Parse arguments and run the chosen command."""
    parser = argparse.ArgumentParser(prog="python -m async_rl.demo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="write model, tokenizer, data, rewards and overrides (.txt, _ppo.txt, _agent.txt, _lora.txt, _long.txt)")
    prep.add_argument("--output-dir", required=True)
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--train-size", type=int, default=DEFAULT_TRAIN_SIZE)
    prep.add_argument("--val-size", type=int, default=DEFAULT_VAL_SIZE)
    prep.add_argument("--model-size", choices=list(MODEL_SIZES), default=DEFAULT_MODEL_SIZE,
                      help="the model's size (async_rl.demo.task.MODEL_SIZES)")
    args = parser.parse_args(argv)

    paths = prepare(args.output_dir, seed=args.seed, train_size=args.train_size, val_size=args.val_size,
                    model_size=args.model_size)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()

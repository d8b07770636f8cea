"""The `conveyor` command: train, config, plot, show, export, warmstart, build-reward-models.

User mistakes (bad config, missing files) end with a one-line `error:` message
and exit status 2, never a traceback; set CONVEYOR_DEBUG=1 to see the traceback
anyway. Anything else is a bug and propagates.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

from conveyor import __version__
from conveyor.files import describe_os_error, environment_error

__all__ = ["main"]

EXIT_USAGE = 2


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", metavar="FILE.yaml", help="YAML config file (overrides go on top; it may stand anywhere among them)"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. actor_rollout_ref.rollout.temperature=0.7",
    )


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command's parser, and the subcommands' parsers that take `--config` and dotted overrides."""
    p = argparse.ArgumentParser(prog="conveyor", description="RL post-training of LLMs over a key-value data plane.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    # -v is taken by --verbose, so the version has the capital letter.
    p.add_argument("-V", "--version", action="version", version=f"conveyor {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser("train", help="run training (no arguments: the default tiny MoE GRPO run)")
    _add_config_args(t)

    c = sub.add_parser("config", help="print the resolved config as YAML")
    _add_config_args(c)
    c.add_argument("--describe", action="store_true", help="add each key's documentation as a comment")

    pl = sub.add_parser("plot", help="draw a run's metrics (and MoE expert load) as PNGs")
    pl.add_argument("run_dir")
    pl.add_argument("--out", help="output folder (default RUN_DIR/plots)")

    sh = sub.add_parser("show", help="print a run's latest generation dump")
    sh.add_argument("run_dir")
    sh.add_argument("--step", type=int, help="a specific dumped step")
    sh.add_argument("-n", type=int, default=8, help="samples to show")

    ex = sub.add_parser(
        "export", help="write a run's policy as a Hugging Face checkpoint (config, safetensors, tokenizer)"
    )
    ex.add_argument("run_dir")
    ex.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    ex.add_argument("--out", required=True, help="a new directory to write")
    ex.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run: write the adapter in PEFT's format instead of the merged model",
    )

    w = sub.add_parser("warmstart", help="build the tiny model's supervised warm start (done on first use anyway)")
    _add_config_args(w)

    b = sub.add_parser(
        "build-reward-models",
        help="write a small reward model and a small judge for the config's synthetic task (docs/rewards.md)",
    )
    # Not required: the subcommand's first parse (before its overrides) sees no options.
    b.add_argument(
        "--out", default="runs/reward_models", help="the folder to write reward_model/ and judge/ into (%(default)s)"
    )
    b.add_argument("--rm-steps", type=int, default=300, help="training steps of the reward model")
    _add_config_args(b)

    v = sub.add_parser(
        "build-vlm", help="write a tiny vision-language model with its tokenizer and image processor (docs/vlm.md)"
    )
    v.add_argument("--arch", default="qwen2_5_vl", help="qwen2_5_vl, qwen3_vl or qwen3_vl_moe (%(default)s)")
    v.add_argument("--out", required=True, help="the checkpoint directory to write (actor_rollout_ref.model.path)")
    v.add_argument("--seed", type=int, default=0, help="seed of the random weights and the warm start (%(default)s)")
    v.add_argument(
        "--warmstart-until",
        type=float,
        default=0.0,
        metavar="ACC",
        help="warm-start on the sum task's (visual_sum) training split until greedy exact match reaches ACC "
        "(0 < ACC <= 1), so that RL has something to learn; 0 = random weights (%(default)s)",
    )
    v.add_argument("--warmstart-steps", type=int, default=4000, help="at most this many warm-start steps (%(default)s)")
    v.add_argument(
        "--max-operand",
        type=int,
        default=9,
        help="the sum task's largest number, as data.synthetic.max_operand (%(default)s)",
    )
    return p, {"train": t, "config": c, "warmstart": w, "build-reward-models": b}


def _parse(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parse `argv`; a subcommand with overrides takes `--config` anywhere among them (`a=b --config f c=d`)."""
    parser, with_overrides = _parser()
    at = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), None)
    if at is None or argv[at] not in with_overrides:
        return parser, parser.parse_args(argv)
    # A plain positional list ends at the first option, so `c=d` after `--config f` would be refused:
    # the subcommand's own arguments are parsed intermixed.
    args = parser.parse_args(argv[: at + 1])
    vars(args).update(vars(with_overrides[argv[at]].parse_intermixed_args(argv[at + 1 :])))
    return parser, args


def _cmd_train(args: argparse.Namespace) -> int:
    from conveyor.config import load_config

    cfg = load_config(args.config, args.overrides)
    try:
        from conveyor.trainer.run import run_training
    except ImportError as err:
        raise ValueError(f"no trainer is available in this installation ({err})") from err
    run_training(cfg)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from conveyor.config import config_to_yaml, load_config
    from conveyor.trainer.plan import build_run_plan
    from conveyor.trainer.setup import resolve_device

    cfg = load_config(args.config, args.overrides)
    # What `train` refuses at its start (the engine's keys included), on the device the config names: a GPU
    # run's config can be prepared and checked on a machine without one, nor with its cores (no resource check).
    build_run_plan(cfg, cfg.trainer.device if cfg.trainer.device != "auto" else resolve_device(cfg))
    sys.stdout.write(config_to_yaml(cfg, with_help=args.describe))
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from conveyor.metrics.plots import plot_run

    paths = plot_run(args.run_dir, args.out)
    for path in paths:
        print(path)
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from conveyor.metrics.dumps import format_generations, latest_generations

    if args.n < 0:
        raise ValueError(f"-n must be 0 or more (the samples to show), got {args.n}")
    step, rows = latest_generations(args.run_dir, step=args.step)
    print(format_generations(step, rows, max_samples=args.n))  # the summary counts the whole dump
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from conveyor.trainer.export import export_hf

    print(export_hf(args.run_dir, args.out, step=args.step, adapter_only=args.adapter_only))
    return 0


def _cmd_warmstart(args: argparse.Namespace) -> int:
    from conveyor.config import load_config
    from conveyor.trainer.setup import prepare_default_model

    cfg = load_config(args.config, args.overrides)
    path = prepare_default_model(cfg)
    print(path)
    return 0


def _cmd_build_reward_models(args: argparse.Namespace) -> int:
    import transformers

    from conveyor.config import load_config
    from conveyor.models.build_scorers import build_judge, build_reward_model
    from conveyor.tasks import SYNTHETIC_TASKS

    # Saving two tiny checkpoints is instant; the library's bars would only clutter the report.
    transformers.utils.logging.disable_progress_bar()
    cfg = load_config(args.config, args.overrides)
    syn = cfg.data.synthetic
    if syn.task != "arithmetic":  # its wrong answers are numbers near the right one
        raise ValueError("build-reward-models knows the arithmetic task only; set data.synthetic.task=arithmetic")
    make = SYNTHETIC_TASKS[syn.task]
    # The run's own splits (data.seed, as `conveyor train` draws them): the reward model never sees the held-out one.
    train = make(syn.num_train, seed=cfg.data.seed, max_operand=syn.max_operand, ops=syn.ops, split="train")
    heldout = make(syn.num_val, seed=cfg.data.seed + 1, max_operand=syn.max_operand, ops=syn.ops, split="test")
    report = build_reward_model(f"{args.out}/reward_model", train, heldout, steps=args.rm_steps, seed=cfg.data.seed)
    print(
        f"{report.path}: reward model, {report.steps} steps in {report.seconds:.0f} s; the sign of its score is right "
        f"for {report.heldout_accuracy:.2f} of {report.heldout_pairs} held-out answers (half right, half wrong)"
    )
    judge = build_judge(f"{args.out}/judge")
    print(f"{judge}: judge (says yes when the response ends in a digit), template {judge / 'template.txt'}")
    return 0


def _cmd_build_vlm(args: argparse.Namespace) -> int:
    from conveyor.models.tiny_vlm import save_tiny_vlm

    if not 0.0 <= args.warmstart_until <= 1.0:
        raise ValueError(f"--warmstart-until must be in [0, 1] (0 = no warm start), got {args.warmstart_until}")
    if args.warmstart_until > 0:
        from conveyor.trainer.warmstart import warm_start_tiny_vlm

        path, losses = warm_start_tiny_vlm(
            args.arch,
            args.out,
            seed=args.seed,
            until_accuracy=args.warmstart_until,
            steps=args.warmstart_steps,
            max_operand=args.max_operand,
        )
        what = f"warm-started {len(losses)} steps on the visual sum task"
    else:
        path, what = save_tiny_vlm(args.arch, args.out, seed=args.seed), "random weights"
    print(
        f"{path}: tiny {args.arch} ({what}; model, tokenizer, image processor); use actor_rollout_ref.model.path={path}"
    )
    return 0


_COMMANDS = {
    "train": _cmd_train,
    "config": _cmd_config,
    "plot": _cmd_plot,
    "show": _cmd_show,
    "export": _cmd_export,
    "warmstart": _cmd_warmstart,
    "build-reward-models": _cmd_build_reward_models,
    "build-vlm": _cmd_build_vlm,
}


# What each command writes, for the message of a failure of the file system.
_COMMAND_WRITES = {
    "train": "writing the run",
    "plot": "writing the plots",
    "export": "writing the export",
    "warmstart": "writing the model cache",
    "build-reward-models": "writing the reward models",
    "show": "reading the dump",
    "config": "reading the config",
}


def _usage_error(message: str) -> int:
    """Print `message` as the `error:` line of a user mistake (re-raise under CONVEYOR_DEBUG=1); exit status 2."""
    if os.environ.get("CONVEYOR_DEBUG"):
        raise  # noqa: PLE0704 - called only from an except block, to show the traceback asked for
    _say(f"error: {one_line(message)}")
    return EXIT_USAGE


def _say(line: str) -> None:
    """Write the command's last line to stderr; a stderr that is gone (a reader that ended, a closed terminal) loses
    the line, never the exit status."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):  # EPIPE, a closed stream, no stderr at all (None)
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)  # nor does the flush at exit fail on it again
            os.close(devnull)
        except OSError:
            pass


def one_line(text: str) -> str:
    """`text` with every unprintable character escaped (a newline or carriage return from the user's input, a lone
    surrogate), so that an error stays one line and the terminal can always print it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `conveyor` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["train"]  # `conveyor` alone runs the default training
    parser, args = _parse(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    from conveyor.metrics.console import BarAwareStreamHandler  # standard library only: cheap at start-up

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        # A log line during training goes below the progress bar, not after its last character.
        handlers=[BarAwareStreamHandler()],
    )
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as err:
        return _usage_error(str(err))
    except Exception as err:
        from conveyor.workers.placement.recovery import RunFailed

        if isinstance(err, RunFailed) and not os.environ.get("CONVEYOR_DEBUG"):  # a fault the run cannot survive
            _say(f"error: {one_line(str(err))}")
            return 1
        # A full disk, a read-only or missing folder, a path under a file: the environment's fault, said in one
        # line. Any other exception is a bug and keeps its traceback.
        cause = environment_error(err)
        if cause is None:
            raise
        return _usage_error(f"{_COMMAND_WRITES.get(args.command, 'the command')} failed: {describe_os_error(cause)}")
    except KeyboardInterrupt as err:
        # 128 + the signal's number, as a shell reports a process a signal ended: 130 for Ctrl-C, 143 for SIGTERM.
        signum = getattr(err, "signum", signal.SIGINT)
        _say("interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}")
        return 128 + int(signum)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The ``flowtrain`` command line: each command's work is imported only when it runs (``--help`` answers at once)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from connectors.secrets import redact, redact_logs
from flowtrain.local.flink.failure import failure_lines


class OneLineErrors(argparse.ArgumentParser):
    """A parser (and its sub-parsers: argparse's ``parser_class``) whose errors are one line, not the usage block:
    ``flowtrain batch: error: unknown option --lable (did you mean --label?) ...; see flowtrain batch --help``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="flowtrain",
        description="Train PyTorch models straight from Apache Beam dataflows.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    from flowtrain.version import __version__

    parser.add_argument("--version", action="version", version=f"flowtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in _command_registrars():
        register(sub)
    return parser


def _command_registrars():
    """Commands with their own modules; each adds its sub-parser (and imports its work lazily)."""
    from flowtrain.cli import batch, bench, compare, drift, features, local, predict, registry, stream, tune

    return [local.register_kafka, batch.register, predict.register, drift.register, bench.register,
            local.register_flink, stream.register, compare.register, registry.register, features.register,
            tune.register]


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str] | None]:
    """The command line as the command will see it: ``(args, beam_args)``, ``beam_args`` None for commands that take
    no Beam options; ``args.options`` holds what --config or the command line set. A bad option exits with status 2."""
    from flowtrain.cli import options

    ours, passthrough = options.split_passthrough(argv)  # after `--`: Beam's, unchecked
    parser = build_parser()
    args, unknown = parser.parse_known_args(ours, namespace=argparse.Namespace())
    sub = getattr(args, "options_parser", None) or _leaf(parser, ours)
    try:
        if getattr(args, "options_parser", None) is not None:
            # --config YAML under the command line; args then holds every option's value
            args.options = options.resolve(parser, args, ours)
        if getattr(args, "accepts_beam_args", False):
            # Options flowtrain does not know must be Beam pipeline options (--runner=..., --flink_master=...).
            options.check_beam_args(unknown, [s for a in sub._actions for s in a.option_strings], command=sub.prog)
            return args, unknown + passthrough
    except options.OptionError as err:
        sub.error(str(err))
    if unknown or passthrough:
        sub.error(_unrecognized(sub, unknown + passthrough))
    return args, None


def _leaf(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub-)parser that read the end of ``argv``: ``flowtrain kafka start``'s for ``kafka start --prot 1``."""
    for token in argv:
        choices = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if choices is not None and token in choices:
            parser = choices[token]
    return parser


def _unrecognized(parser: argparse.ArgumentParser, tokens: list[str]) -> str:
    """``unknown option --prot (did you mean --port?)``, or the tokens argparse could not place."""
    from flowtrain.cli.options import closest_flag

    flags = [s for a in parser._actions for s in a.option_strings]
    named = []
    for token in tokens:
        name = token.split("=", 1)[0]
        close = closest_flag(name, flags) if name.startswith("-") else None
        if close:
            named.append(f"{name} (did you mean {close}?)")
    if named and len(named) == len([t for t in tokens if t.startswith("-")]):
        return f"unknown option{'s' if len(named) > 1 else ''} {', '.join(named)}"
    return f"unrecognized arguments: {' '.join(tokens)}"


def _drop_import_noise(record: logging.LogRecord) -> bool:
    """Beam's BigQuery client package warns on import, through the root logger, that apitools is
    missing (flowtrain uses no BigQuery): that line would come before every error message."""
    return not str(record.msg).startswith("apitools not found")


def main(argv: list[str] | None = None) -> int:
    logging.getLogger().addFilter(_drop_import_noise)
    redact_logs()  # a URL's credentials never reach a log line (connectors.secrets)
    args, beam_args = parse(list(sys.argv[1:] if argv is None else argv))
    from flowtrain.errors import FlowtrainError

    try:
        if beam_args is None:
            return int(args.func(args) or 0)
        return int(args.func(args, beam_args) or 0)
    except FlowtrainError as err:  # a user's error: one line naming the input and the fix
        print(f"flowtrain {args.command}: {redact(str(err))}", file=sys.stderr)  # never a URL's credentials
        return int(getattr(err, "exit_code", 2))  # 3: the input was read but could not be used (flowtrain.errors)
    except RuntimeError as err:  # a failed Flink job: its error, then where it failed (Flink's exception history)
        if not (lines := failure_lines(err, getattr(args, "flink_master", None))):
            raise
        print(redact(f"flowtrain {args.command}: " + "\n  ".join(lines)), file=sys.stderr)
        return 1


def entry() -> None:
    """The process entry point (the ``flowtrain`` command, ``python -m flowtrain.cli``).

    A command that failed with its one-line message runs the exit handlers (Beam's stop the
    runner and job-server processes it started, flowtrain's close Kafka clients) and then ends
    without the rest of the interpreter's teardown: a native thread that torch or Beam's gRPC
    started could otherwise abort the process while it is destroyed ("terminate called without
    an active exception", SIGABRT, seen after a schema error), turning exit status 2 into a crash.

    SIGINT is made to stop the command even where it was inherited as ignored (a POSIX shell starts a script's
    background job `flowtrain ... &` so, and Python then installs no KeyboardInterrupt handler): Ctrl-C and
    `kill -INT` stop every flowtrain command alike."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    code = main()
    if code:
        import atexit

        atexit._run_exitfuncs()  # the documented handlers, in their order (CPython's own exit runs them too)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(0)


if __name__ == "__main__":
    entry()

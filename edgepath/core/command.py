"""One ``edgepath`` command: its arguments and its handler, kept in the module it runs.

Every stage module ends with a ``COMMAND`` (a ``Command``); ``edgepath.cli`` only
composes them under ``edgepath <name>``, and a stage's DVC entry point
(``stages/<name>.py``) runs its own module's ``COMMAND`` with ``run``, importing
nothing else. This module is deliberately light: argparse and the standard library.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
import time
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

PROG = "edgepath"


@dataclasses.dataclass(frozen=True)
class Command:
    """``edgepath <name>``: a leaf (``handler``) or a group of ``subcommands``
    (``manifest build|show``, ``images plan|bake``), never both."""

    name: str
    help: str
    """One line, in ``edgepath --help``'s list."""
    description: str
    """``edgepath <name> --help``'s text (dedented)."""
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    handler: Callable[[argparse.Namespace], None] | None = None
    """Runs the command; raises ``EdgepathError`` for what the user must fix."""
    subcommands: tuple[Command, ...] = ()

    def __post_init__(self) -> None:
        if (self.handler is None) == (not self.subcommands):
            raise ValueError(f"command {self.name!r}: a handler or subcommands, exactly one")

    def add_to(self, subparsers: Any) -> argparse.ArgumentParser:
        """Add this command to a parser's ``add_subparsers()``."""
        parser = subparsers.add_parser(self.name, help=self.help, description=textwrap.dedent(self.description),
                                       formatter_class=formatter)
        self._fill(parser)
        return parser

    def parser(self, prog: str = PROG) -> argparse.ArgumentParser:
        """This command alone, as ``<prog> <name>``."""
        parser = argparse.ArgumentParser(prog=f"{prog} {self.name}", description=textwrap.dedent(self.description),
                                         formatter_class=formatter)
        self._fill(parser)
        return parser

    def _fill(self, parser: argparse.ArgumentParser) -> None:
        if self.add_arguments is not None:
            self.add_arguments(parser)
        if self.subcommands:
            sub = parser.add_subparsers(dest="action", metavar="<action>", required=True)
            for command in self.subcommands:
                command.add_to(sub)
        else:
            parser.set_defaults(handler=self.handler)


def formatter(prog: str) -> argparse.HelpFormatter:
    """Every edgepath parser's: descriptions keep their line breaks."""
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)


def call(name: str, args: argparse.Namespace) -> int:
    """Run parsed ``args`` (their ``handler``): 0, or 2 with one line on stderr,
    ``edgepath <name>: error: ...``, where the handler refused (``EdgepathError``) or
    met an expected failure (an OS error, undecodable input: ``files.describe``); 130
    on Ctrl-C. Anything else is a bug and keeps its traceback."""
    try:
        args.handler(args)
    except KeyboardInterrupt:
        print(f"{PROG} {name}: interrupted; outputs are written atomically, so none is half-written",
              file=sys.stderr)
        return 130
    except Exception as e:
        from .files import describe

        line = describe(e)
        if line is None:
            raise
        print(f"{PROG} {name}: error: {printable(line)}", file=sys.stderr)
        return 2
    return 0


# What ``printable`` escapes: controls (C0 with ESC, CR and newline; DEL; C1), format
# characters (bidi overrides and isolates, zero-width marks) and line/paragraph separators.
_UNPRINTABLE = frozenset(("Cc", "Cf", "Zl", "Zp"))


def printable(value: Any) -> Any:
    """``value`` (a string, or a record's lists and objects of them) with every
    character that would act on a terminal rather than show written as an escape
    (``\\x1b``, ``\\u202e``): what edgepath prints from a file (a manifest's text, an
    error naming a key) cannot move the cursor, recolour, clear the screen, reorder the
    text or break one line into several."""
    if isinstance(value, str):
        return "".join(_escape(c) if unicodedata.category(c) in _UNPRINTABLE else c for c in value)
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(printable(v) for v in value)
    return value


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def run(command: Command, argv: Sequence[str] | None = None) -> int:
    """``edgepath <command.name> ARGV``: parse, run, and return the exit status."""
    return call(command.name, command.parser().parse_args(argv))


def emit(text: str, out: str | None, name: str, record: dict[str, Any]) -> None:
    """Write ``record`` (a record of kind ``name``) to ``out``, or print ``text`` where
    no ``--out`` was given."""
    if out is not None:
        from . import records

        records.write(out, name, record)
    else:
        sys.stdout.write(text)


def progress(who: str, message: str) -> None:
    """One line of a long command's progress on stderr, with the time: ``who: HH:MM:SS message``."""
    print(f"{who}: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)

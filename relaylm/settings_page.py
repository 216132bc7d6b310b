"""The documentation's settings page, generated from the ``relaylm`` command's own click options
(the ones ``--help`` prints), so the page cannot drift from the command.

``python -m relaylm.settings_page`` rewrites ``docs/settings.md``; ``--check`` only compares it
(exit status 1 when it differs). The tests compare it too.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from relaylm.cli import main as relaylm_command

PAGE = Path(__file__).resolve().parents[1] / "docs" / "settings.md"

# settings_options() ends every help text with "[env: NAME; default: VALUE]" (a repeated option:
# "[env: NAME, how several are given; default: what happens without one]").
_ENV_AND_DEFAULT = re.compile(r"\s*\[env: (?P<env>[^;\]]+); default: (?P<default>[^\]]*)\]\s*$", re.DOTALL)

_HEADER = """\
# Settings

Every flag of `relaylm api`, `relaylm worker` and `relaylm serve`, and the environment variable
that sets it when the flag is not given (a flag wins over its variable, the variable over the
default). `relaylm serve` takes the API's and the worker's flags together and passes each
process its own; `--model` may be given to it several times (one worker per model).
`relaylm COMMAND --help` prints the same list.

This page is generated from the command's options by `python -m relaylm.settings_page`; the
tests fail when it differs from them.
"""


@dataclass(frozen=True)
class Flag:
    flag: str
    env: str
    default: str
    meaning: str

    def row(self) -> str:
        return f"| `{self.flag}` | `{self.env}` | `{self.default}` | {_cell(self.meaning)} |"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flags(command: click.Command) -> dict[str, Flag]:
    flags: dict[str, Flag] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name is None or param.help is None:
            continue
        match = _ENV_AND_DEFAULT.search(param.help)
        if match is None:
            raise ValueError(f"{command.name} {param.opts[0]}: help text without [env: ...; default: ...]")
        flag = " / ".join([*param.opts, *param.secondary_opts])
        flags[param.name] = Flag(flag, match["env"], match["default"], param.help[: match.start()])
    return flags


def _table(flags: list[Flag]) -> str:
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    return "\n".join([*rows, *(flag.row() for flag in flags)])


def render() -> str:
    commands = relaylm_command.commands  # type: ignore[attr-defined]
    api, worker, serve = (_flags(commands[name]) for name in ("api", "worker", "serve"))
    both = [flag for name, flag in api.items() if name in worker]
    sections = [
        ("Both processes", "Read by `relaylm api`, `relaylm worker` and `relaylm serve`.", both),
        ("API", "`relaylm api`, and `relaylm serve`.", [f for n, f in api.items() if n not in worker]),
        ("Worker", "`relaylm worker`, and `relaylm serve`.", [f for n, f in worker.items() if n not in api]),
    ]
    serve_only = [flag for name, flag in serve.items() if flag != api.get(name, worker.get(name))]
    if serve_only:
        sections.append(("Serve", "How `relaylm serve` reads these flags differently.", serve_only))
    parts = [_HEADER]
    for title, intro, flags in sections:
        parts.append(f"## {title}\n\n{intro}\n\n{_table(flags)}\n")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE} differs from the relaylm command's options: run python -m relaylm.settings_page")
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

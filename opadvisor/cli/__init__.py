"""The `opadvisor` command line: parses arguments and renders results; the work happens elsewhere.

Each command lives in its own module here and registers itself on `app`. Heavy imports (torch, libcst)
happen inside the commands, so `opadvisor --help` and `opadvisor rules` answer at once.
"""

from __future__ import annotations

from typing import Annotated

import typer

from opadvisor.cli import apply as _apply
from opadvisor.cli import diff as _diff
from opadvisor.cli import profile as _profile
from opadvisor.cli import report as _report
from opadvisor.cli import suggest as _suggest
from opadvisor.cli import verify as _verify

app = typer.Typer(
    name="opadvisor",
    help=(
        "Find where a PyTorch training script loses GPU time, rewrite it to fused kernels, and prove it.\n\n"
        "\b\n"  # click keeps this paragraph's lines as they are
        "  opadvisor profile train.py      measure a few steps\n"
        "  opadvisor suggest               findings ranked by measured time\n"
        "  opadvisor apply --rule RULE     rewrite the source (libcst), with a diff\n"
        "  opadvisor verify                same losses? how much faster?\n"
        "  opadvisor report / diff         an HTML report; two runs compared"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from opadvisor import __version__

        print(f"opadvisor {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print opadvisor's version and exit.", is_eager=True, callback=_print_version
        ),
    ] = False,
) -> None:
    # A callback keeps `opadvisor` a group of commands, whatever number of commands is registered.
    pass


for _module in (_profile, _suggest, _apply, _verify, _report, _diff):
    _module.register(app)


def main() -> None:
    app()

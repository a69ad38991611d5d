"""The ``kvrouter-loadtest`` command line."""

from __future__ import annotations

import typer

from loadtest import cmd_compare, cmd_run, cmd_sim
from loadtest.cmd_emulate import emulate

app = typer.Typer(
    name="kvrouter-loadtest",
    help="Load generation, an emulated SGLang/vLLM DP-attention engine, and a placement simulator.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Subcommands: emulate, run, sim, compare."""


cmd_run.register(app)
cmd_compare.register(app)
cmd_sim.register(app)
app.command("emulate")(emulate)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

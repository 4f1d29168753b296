"""The root typer app and its mounted sub-apps."""

from __future__ import annotations

from importlib.metadata import entry_points

import typer

from inferplane.cli._bench import bench
from inferplane.cli._conformance import conformance
from inferplane.cli._up import status, up
from inferplane.parsers.cli import app as parsers_app

app = typer.Typer(
    name="inferplane",
    help="Serve open-weight LLMs behind an OpenAI-compatible API.",
    no_args_is_help=True,
    add_completion=False,
)
app.command()(up)
app.command()(status)
app.command()(bench)
app.command()(conformance)
app.add_typer(parsers_app, name="parsers", help="Run the reasoning and tool-call parsers.")


#: Entry-point group through which services plug their admin CLIs in (pyproject.toml): a name
#: and a `typer.Typer` (mounted as that sub-command) or a function (mounted as that command).
#: libs/ never imports services/; the installed distribution says what is there.
CLI_ENTRY_POINTS = "inferplane.cli"


def mount_service_clis(root: typer.Typer, group: str = CLI_ENTRY_POINTS) -> list[str]:
    """Mounts every CLI registered under the entry-point `group` on `root`, in name order;
    returns the names mounted.

    Raises: TypeError for an entry point that is neither a `typer.Typer` nor a callable.
    """
    mounted = []
    for entry in sorted(entry_points(group=group), key=lambda e: e.name):
        target = entry.load()
        if isinstance(target, typer.Typer):
            root.add_typer(target, name=entry.name)
        elif callable(target):
            root.command(name=entry.name)(target)
        else:
            raise TypeError(f"CLI entry point {entry.name} ({entry.value}) is not a typer app")
        mounted.append(entry.name)
    return mounted


mount_service_clis(app)

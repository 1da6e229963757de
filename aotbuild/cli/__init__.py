"""The command line: ``commands`` (every command, its options and output), ``doctor`` and ``bench``
(the work of the commands of those names)."""


def main() -> None:
    """The ``aotbuild`` console script and ``python -m aotbuild.cli``: :func:`aotbuild.cli.commands.main`,
    imported when called (a child that imports ``aotbuild.cli.bench`` does not load click's commands)."""
    from aotbuild.utils.secrets import install_streams

    install_streams()  # every line the command prints, scrubbed of secrets (issue 53)
    from aotbuild.cli.commands import main as commands

    commands()

"""``python -m flashcore`` and the ``flashcore`` script: see :mod:`flashcore._cli`."""
import sys


def main(argv=None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    from ._cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())

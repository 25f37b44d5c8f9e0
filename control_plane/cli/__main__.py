"""`python -m control_plane.cli`: the `met` command."""

from control_plane.cli.main import main

if __name__ == "__main__":
    main()

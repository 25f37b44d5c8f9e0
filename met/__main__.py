"""`python -m met`: the `met` command."""

from met.main import main

if __name__ == "__main__":
    main()

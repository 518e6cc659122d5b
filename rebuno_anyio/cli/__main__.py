"""`python -m rebuno_anyio.cli` runs the `rebuno` command."""

from . import main

main()

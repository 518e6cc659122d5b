"""The `rebuno` command: run a kernel (`dev`, `server`) and talk to one.

Built on click (subcommands, options, help) and rich (tables for people);
`--json` prints machine-readable output for scripts. Client verbs talk HTTP to
`--url` / `REBUNO_URL` with `--api-key` / `REBUNO_API_KEY`.
"""

from __future__ import annotations

from ._main import main

__all__ = ["main"]

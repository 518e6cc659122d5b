"""Import-direction checks that import-linter cannot express.

`rebuno_anyio` may reach `rebuno_asgi` lazily (e.g. `Agent.app`), but importing
any `rebuno_anyio` module must not import `rebuno_asgi`. Each module is imported
in a fresh interpreter so one cannot mask another.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import rebuno_anyio

PROBE = (
    "import importlib, sys; importlib.import_module({name!r}); "
    "sys.exit(3 if 'rebuno_asgi' in sys.modules else 0)"
)


def main() -> int:
    names = ["rebuno_anyio"] + [
        m.name
        for m in pkgutil.walk_packages(rebuno_anyio.__path__, "rebuno_anyio.")
        if not m.name.endswith("__main__")
    ]
    bad, broken = [], []
    for name in names:
        code = subprocess.run(
            [sys.executable, "-c", PROBE.format(name=name)], check=False
        ).returncode
        if code == 3:
            bad.append(name)
        elif code:
            broken.append(name)
    for name in bad:
        print(f"importing {name} imports rebuno_asgi (rebuno_anyio must stay below it)")
    for name in broken:
        print(f"{name} cannot be imported on its own (see the traceback above)")
    print(f"checked {len(names)} rebuno_anyio modules: {'FAIL' if bad or broken else 'ok'}")
    return 1 if bad or broken else 0


if __name__ == "__main__":
    sys.exit(main())

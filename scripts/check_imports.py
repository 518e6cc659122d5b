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
    "sys.exit('rebuno_asgi' in sys.modules)"
)


def main() -> int:
    names = ["rebuno_anyio"] + [
        m.name
        for m in pkgutil.walk_packages(rebuno_anyio.__path__, "rebuno_anyio.")
        if not m.name.endswith("__main__")
    ]
    bad = [
        name
        for name in names
        if subprocess.run([sys.executable, "-c", PROBE.format(name=name)], check=False).returncode
    ]
    for name in bad:
        print(f"importing {name} imports rebuno_asgi (rebuno_anyio must stay below it)")
    print(f"checked {len(names)} rebuno_anyio modules: {'FAIL' if bad else 'ok'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

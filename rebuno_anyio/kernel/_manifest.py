"""The dev manifest (Rebuno's format): the agents a kernel registers at start.

```yaml
agents:
  - id: hello
    webhook_url: http://127.0.0.1:5000/webhook
    secret: dev-secret
    policy:            # inline bundle, or
    policy_file: p.yaml  # a path relative to the manifest
```
Errors name the agent and the field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import yaml

from rebuno_proto import MessageError, dumps, parse_agent_registration

from ._urls import webhook_url_problem

__all__ = ["ManifestAgent", "ManifestError", "load_manifest"]

_AGENT_KEYS = frozenset({"id", "webhook_url", "secret", "policy", "policy_file"})


class ManifestError(ValueError):
    """The manifest cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class ManifestAgent:
    id: str
    webhook_url: str
    secret: str
    policy: str | None  # the bundle as YAML text


def load_manifest(path: str) -> list[ManifestAgent]:
    """Read and validate a manifest file.

    Raises:
        ManifestError: unreadable file, bad YAML, or an invalid agent entry.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as err:
        raise ManifestError(f"cannot read manifest {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ManifestError(
            f"manifest {path} is not UTF-8 text (byte {err.start}: {err.reason})"
        ) from None
    except yaml.YAMLError as err:
        raise ManifestError(f"manifest {path} is not valid YAML: {err}") from None
    except RecursionError:
        raise ManifestError(f"manifest {path}: nested too deeply") from None
    try:
        return _agents(data, path)
    except RecursionError:  # a deep value in an entry (dumping it, or a policy)
        raise ManifestError(f"manifest {path}: nested too deeply") from None


def _agents(data: Any, path: str) -> list[ManifestAgent]:
    if data is None:
        return []
    if not isinstance(data, dict) or set(data) - {"agents"}:
        raise ManifestError(f"manifest {path}: the top level must be a mapping with 'agents'")
    entries = data.get("agents") or []
    if not isinstance(entries, list):
        raise ManifestError(f"manifest {path}: 'agents' must be a list")
    base = os.path.dirname(os.path.abspath(path))
    agents = [_agent(entry, i, path, base) for i, entry in enumerate(entries)]
    ids = [a.id for a in agents]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ManifestError(f"manifest {path}: agent ids repeated: {', '.join(duplicates)}")
    return agents


def _agent(entry: Any, index: int, path: str, base: str) -> ManifestAgent:
    where = f"manifest {path}: agents[{index}]"
    if not isinstance(entry, dict):
        raise ManifestError(f"{where} must be a mapping")
    where = f"manifest {path}: agent {entry.get('id', index)!r}"
    unknown = sorted(map(str, set(entry) - _AGENT_KEYS))
    if unknown:
        raise ManifestError(f"{where}: unknown keys {', '.join(unknown)}")
    body = {k: entry.get(k) for k in ("id", "webhook_url", "secret")}
    for key, value in body.items():
        # YAML has types JSON lacks (dates, sets, binary): say so, do not crash.
        if value is not None and not isinstance(value, str | int | float | bool | list | dict):
            raise ManifestError(f"{where}: {key}: must be a string, got {type(value).__name__}")
    try:
        reg = parse_agent_registration(dumps(body).encode("utf-8"))  # type: ignore[arg-type]
    except MessageError as err:
        raise ManifestError(f"{where}: {err}") from None
    problem = webhook_url_problem(reg.webhook_url)
    if problem is not None:
        raise ManifestError(f"{where}: webhook_url: {problem}")
    if "policy" in entry and "policy_file" in entry:
        raise ManifestError(f"{where}: give policy or policy_file, not both")
    policy: str | None = None
    if entry.get("policy") is not None:
        policy = yaml.safe_dump(entry["policy"], sort_keys=False)
    elif entry.get("policy_file") is not None:
        file = os.path.join(base, str(entry["policy_file"]))
        try:
            with open(file, encoding="utf-8") as f:
                policy = f.read()
        except OSError as err:
            raise ManifestError(
                f"{where}: cannot read policy_file {file}: {err.strerror}"
            ) from None
        except UnicodeDecodeError as err:
            raise ManifestError(
                f"{where}: policy_file {file} is not UTF-8 text (byte {err.start}: {err.reason})"
            ) from None
    return ManifestAgent(id=reg.id, webhook_url=reg.webhook_url, secret=reg.secret, policy=policy)

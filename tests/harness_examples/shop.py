"""A user's agent module, as it would be deployed: an `Agent`, tools with side
effects, and a handler. `ledger` stands in for the outside world: each tool
body appends to it, so a test can count effects."""

from __future__ import annotations

from typing import Any

from rebuno_anyio import Agent, PolicyError, step, tool

agent = Agent("shop", secret="shop-secret", base_url="http://kernel.example:8080")
ledger: list[str] = []


@tool("reserve")
async def reserve(sku: str) -> str:
    ledger.append(f"reserve {sku}")
    return f"held-{sku}"


@tool("charge", idempotency="at_most_once")
async def charge(order: int, cents: int) -> str:
    ledger.append(f"charge {order}")
    return f"ch_{order}"


@tool("send_email")
async def send_email(to: str, text: str) -> str:
    ledger.append(f"email {to}")
    return "sent"


async def process(order: int, sku: str, cents: int) -> dict[str, Any]:
    """Reserve, charge, pick a courier (a local step), email: four steps."""
    hold = await reserve(sku)
    charge_id = await charge(order, cents)
    courier = await step("pick_courier", lambda: "fast-co")
    mail = await send_email("buyer@example.com", f"order {order}: {charge_id}")
    return {"hold": hold, "charge": charge_id, "courier": courier, "mail": mail}


async def audit(order: int) -> str:
    """A handler whose local step policy may deny: it lets `PolicyError` out."""
    try:
        return await step("read_audit_log", lambda: f"log of {order}")
    except PolicyError:
        ledger.append("audit refused")
        raise


ORDER = {"order": 7, "sku": "mug", "cents": 1999}

"""The alert bot's layers stay typed: nothing outside the store indexes a store result by a string,
no state or kind is compared with a bare string, the store's repositories return records (never
driver rows) and neither they nor the channels' signatures fall back to `Any`."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from enum import StrEnum
from pathlib import Path

import pytest

from megatrace.alertbot import kinds
from megatrace.alertbot import store as store_package
from megatrace.alertbot.channels import Channel
from megatrace.alertbot.channels.base import FeishuCardChannel
from megatrace.alertbot.store import Store, records
from megatrace.alertbot.store.coordination import Coordination
from megatrace.alertbot.store.episodes import Episodes
from megatrace.alertbot.store.inbox import Inbox
from megatrace.alertbot.store.incidents import Incidents
from megatrace.alertbot.store.outbox import Outboxes

BOT = Path(store_package.__file__).parent.parent
STATE_NAMES = frozenset({"state", "status", "kind", "outcome"})
REPOSITORIES = (Inbox, Episodes, Incidents, Outboxes, Coordination)
OUR_VALUES = frozenset(
    member.value
    for enum in vars(kinds).values()
    if inspect.isclass(enum) and issubclass(enum, StrEnum) and enum is not StrEnum
    for member in enum
)


def bot_modules() -> list[Path]:
    """Every module of the bot outside the store (which alone reads driver rows)."""
    return [p for p in sorted(BOT.rglob("*.py")) if "store" not in p.relative_to(BOT).parts]


def from_store(node: ast.AST) -> bool:
    """Whether `node` contains a call made on the store (``….store.<repository>.<method>(…)``)."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute):
            chain = ast.unparse(inner.func)
            if ".store." in f".{chain}" or chain.startswith("store."):
                return True
    return False


def names_bound_to_store_results(tree: ast.AST) -> set[str]:
    bound: set[str] = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign) and from_store(node.value):
            targets = node.targets
        elif (
            isinstance(node, ast.AnnAssign | ast.NamedExpr)
            and node.value is not None
            and from_store(node.value)
        ) or (isinstance(node, ast.For | ast.comprehension) and from_store(node.iter)):
            targets = [node.target]
        for target in targets:
            bound |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return bound


def string_subscripts_of_store_results(source: str) -> list[str]:
    tree = ast.parse(source)
    bound = names_bound_to_store_results(tree)
    return [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id in bound
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    ]


def is_bare_string(node: ast.expr) -> bool:
    """A literal that spells one of the bot's own states or kinds (not a value of an outside protocol,
    such as Alertmanager's silence state ``active``)."""
    if isinstance(node, ast.Constant):
        return node.value in OUR_VALUES
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(is_bare_string(e) for e in node.elts)


def is_state(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in STATE_NAMES) or (
        isinstance(node, ast.Name) and node.id in STATE_NAMES
    )


def bare_state_strings(source: str) -> list[str]:
    """Comparisons of a state/status/kind/outcome with string literals, and such arguments given as one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_state(s) for s in sides) and any(is_bare_string(s) for s in sides):
                found.append(ast.unparse(node))
        if isinstance(node, ast.Call) and from_store(node):
            found += [
                ast.unparse(k) for k in node.keywords if k.arg in STATE_NAMES and is_bare_string(k.value)
            ]
    return found


def test_the_checks_catch_what_they_forbid() -> None:
    sample = (
        "row = self.store.outbox.get(1)\n"
        "x = row['state']\n"
        "for e in store.episodes.firing():\n    y = e['id']\n"
        "if row.state == 'sent':\n    pass\n"
        "self.store.outbox.update(1, state='dead')\n"
    )
    assert string_subscripts_of_store_results(sample) == ["row['state']", "e['id']"]
    assert bare_state_strings(sample) == ["row.state == 'sent'", "state='dead'"]


@pytest.mark.parametrize("path", bot_modules(), ids=lambda p: str(p.relative_to(BOT)))
def test_no_store_result_is_indexed_by_a_string(path: Path) -> None:
    assert string_subscripts_of_store_results(path.read_text()) == []


@pytest.mark.parametrize("path", bot_modules(), ids=lambda p: str(p.relative_to(BOT)))
def test_no_state_is_compared_with_a_bare_string(path: Path) -> None:
    assert bare_state_strings(path.read_text()) == []


def public_methods(cls: type) -> list[tuple[str, dict[str, object]]]:
    return [
        (name, typing.get_type_hints(member))
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    ]


def mentions(hint: object, wanted: object) -> bool:
    return hint is wanted or any(mentions(arg, wanted) for arg in typing.get_args(hint))


RECORDS = {cls for cls in vars(records).values() if inspect.isclass(cls) and dataclasses.is_dataclass(cls)}
PLAIN = {int, float, str, bool, type(None), list, tuple, dict}


def plain_or_records(hint: object) -> bool:
    origin = typing.get_origin(hint)
    if origin is None:
        return hint in RECORDS or hint in PLAIN
    return all(plain_or_records(arg) for arg in typing.get_args(hint))


@pytest.mark.parametrize("repository", REPOSITORIES, ids=lambda cls: cls.__name__)
def test_repositories_return_records_and_take_no_any(repository: type) -> None:
    for name, hints in public_methods(repository):
        assert plain_or_records(hints["return"]), f"{repository.__name__}.{name} returns {hints['return']}"
        assert not any(mentions(h, typing.Any) for h in hints.values()), f"{repository.__name__}.{name}"


def test_the_store_protocol_names_only_typed_repositories() -> None:
    hints = typing.get_type_hints(Store)
    assert {hints[name] for name in ("inbox", "episodes", "incidents", "outbox", "coordination")} == set(
        REPOSITORIES
    )
    assert not any(mentions(h, typing.Any) for h in hints.values())
    for _, method in public_methods(Store):
        assert not any(mentions(h, typing.Any) for h in method.values())


@pytest.mark.parametrize("channel", [Channel, FeishuCardChannel], ids=lambda cls: cls.__name__)
def test_channel_signatures_have_no_any(channel: type) -> None:
    for name, hints in public_methods(channel):
        assert not any(mentions(h, typing.Any) for h in hints.values()), f"{channel.__name__}.{name}: {hints}"

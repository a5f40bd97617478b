"""The demo's passages and questions are well formed and answerable from their own passages."""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

import pytest


@pytest.fixture(scope="module")
def demo() -> dict[str, Any]:
    # Read through importlib.resources, as the demo does once installed as a package.
    text = files("kvblend.demo").joinpath("passages.json").read_text(encoding="utf-8")
    return json.loads(text)


def test_shape(demo: dict[str, Any]) -> None:
    assert len(demo["passages"]) == 6
    assert len(demo["questions"]) == 5
    for passage in demo["passages"]:
        assert isinstance(passage, str)
        assert 60 <= len(passage.split()) <= 120
    assert len(set(demo["passages"])) == len(demo["passages"])
    for item in demo["questions"]:
        assert set(item) == {"question", "passages", "answer"}
        assert item["question"].strip() and item["answer"].strip()


def test_indices_valid(demo: dict[str, Any]) -> None:
    n = len(demo["passages"])
    for item in demo["questions"]:
        indices = item["passages"]
        assert 3 <= len(indices) <= 4
        assert len(set(indices)) == len(indices), "a passage listed twice"
        assert all(isinstance(i, int) and 0 <= i < n for i in indices)


def test_answer_in_listed_passage(demo: dict[str, Any]) -> None:
    for item in demo["questions"]:
        answer = item["answer"].lower()
        texts = [demo["passages"][i].lower() for i in item["passages"]]
        assert any(answer in text for text in texts), item["question"]


def test_orders_differ(demo: dict[str, Any]) -> None:
    orders = [tuple(item["passages"]) for item in demo["questions"]]
    assert len(set(orders)) == len(orders)
    # The point of the demo: some chunk is reused at different positions in different prompts.
    positions: dict[int, set[int]] = {}
    for order in orders:
        for pos, index in enumerate(order):
            positions.setdefault(index, set()).add(pos)
    assert any(len(seen) > 1 for seen in positions.values())

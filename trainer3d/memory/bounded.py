"""A bounded memo for the planner's caches of what a layout's memory and step depend on
(trainer3d/memory/rank_layout.py, staged.py, peak.py; trainer3d/plan/moe_cost.py): their
arguments are configs, which do not hash, so each cache is keyed on the knobs its value
depends on, and holds at most ``size`` values, the least recently used dropped first
(``functools.lru_cache``'s policy): a long-lived process planning many models stays bounded.
"""

from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


class Bounded(Generic[V]):
    def __init__(self, size: int):
        self.size = size
        self._values: "OrderedDict[Hashable, V]" = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value cached under ``key``, else ``make()``'s, cached."""
        values = self._values
        if key in values:
            values.move_to_end(key)
            return values[key]
        value = values[key] = make()
        if len(values) > self.size:
            values.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._values)

    def clear(self) -> None:
        self._values.clear()

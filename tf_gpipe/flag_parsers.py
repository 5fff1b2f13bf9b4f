"""absl argument parsers for the values of tf_gpipe's flags (``tf_gpipe.flags``): a stage
balance (``--balance``) and a size in bytes (``--plan_memory_budget``).

Each turns the command line's text, or a default given as a Python value, into what
``PipelineModel`` and ``tf_gpipe.plan`` take, and refuses anything else with a message
absl shows beside the flag's name.
"""

from __future__ import annotations

import re
from typing import Any, TypeAlias

from absl import flags

__all__: list[str] = []

# Balancing by measured cost: PipelineModel profiles the layers, the flag passes the name on.
BALANCE_METHODS = ("params", "time", "memory")

Balance: TypeAlias = list[int] | str | None


class BalanceParser(flags.ArgumentParser):
    """``"3,3,2,2"`` -> ``[3, 3, 2, 2]``; a method name stays a string; ``""`` -> None."""

    syntactic_help = "a comma-separated list of positive integers (layers per stage), or one of " + ", ".join(
        repr(m) for m in BALANCE_METHODS
    )

    def parse(self, argument: Any) -> Balance:
        if argument is None:
            return None
        if not isinstance(argument, str):  # a default given as a Python value
            if isinstance(argument, (list, tuple)):
                return self._check([a for a in argument])
            raise ValueError(f"expected {self.syntactic_help}, got {argument!r}")
        text = argument.strip()
        if not text:
            return None
        if text in BALANCE_METHODS:
            return text
        try:
            values = [int(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(
                f"expected {self.syntactic_help}, got {argument!r}; "
                "for example --balance=3,3,2,2 or --balance=params"
            ) from None
        return self._check(values)

    def _check(self, values: list[Any]) -> list[int]:
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"every entry must be a positive integer (layers per stage), got {values!r}")
        return list(values)

    def flag_type(self) -> str:
        return "balance"


class BalanceSerializer(flags.ArgumentSerializer):
    def serialize(self, value: Balance) -> str:
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        return ",".join(str(v) for v in value)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"2GiB"`` -> 2147483648: bytes, or a number with a unit (B, KB, MB, GB, KiB, MiB, GiB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is no size: give bytes, or a number with a unit such as 512MiB or 2GiB")
    return int(float(match.group(1)) * _UNITS[unit])


class BytesParser(flags.ArgumentParser):
    syntactic_help = "bytes, or a number with a unit (B, KB, MB, GB, KiB, MiB, GiB), e.g. 2GiB"

    def parse(self, argument: Any) -> int | None:
        if argument in (None, ""):
            return None
        return argument if isinstance(argument, int) else parse_bytes(argument)

"""What one conformance case's run found (standard and MLA cases alike)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Outcome:
    """What one case's run found."""

    #: Largest relative error of any real request of any step.
    worst: float = 0.0
    #: Which step and request it was.
    worst_where: str = ""
    #: Everything else that is wrong, each prefixed with its step in multi-step cases.
    problems: list[str] = field(default_factory=list)

"""Pictures of findings, campaigns and gate runs, for the people who read them.

A maintainer deciding whether a report is real looks at three pictures of a finding: the
**schedule** (which request ran when, next to which, with what cached, on which adapter), the
**divergence** (each generated position's logprobs and margins, run against reference, inside
the dtype's noise bounds), and the **controls and ablation** grid (where it reproduces). A
campaign gets a page of its progress and buckets, a gate run a page of its cases.

The presentation sits on top of the rooms and never inside them: ``oracle/`` stays pure
judgement. Each picture's data is computed by small pure functions (``data``: plain
dataclasses from a Finding, no matplotlib; tested on real recorded histories) and drawn
separately (``draw``: matplotlib, the optional ``[plots]`` extra). ``pages`` assembles
self-contained HTML (inline SVG, inline CSS, no script, nothing fetched).
"""

from __future__ import annotations

from .deps import PLOTS_HINT, have_matplotlib

__all__ = ["PLOTS_HINT", "campaign_page", "have_matplotlib"]


def campaign_page(out, state, *, final: bool = False) -> None:
    """Write ``OUT/campaign.html`` for a campaign's state (called where campaign.json is
    written). Never raises: a page is a convenience, the campaign goes on without it."""
    from .pages import write_campaign_page

    write_campaign_page(out, state, final=final)


def gate_page(out) -> None:
    """Write ``OUT/gate.html`` from ``OUT/gate.json`` (called where the gate writes its
    reports). Never raises."""
    from .pages import write_gate_page

    write_gate_page(out)


__all__ = ["PLOTS_HINT", "campaign_page", "gate_page", "have_matplotlib"]

"""The tables, headline rows and figure of ``bench_peer.py``, from its cells."""

from __future__ import annotations

from typing import Any

from _common import Options, headline, write_png

#: Goals of ours/peer once the encoder core runs its no-op engine calls inline.
GOALS = {1: 1.2, 64: 2.0}
#: Goals where both sides call their engine the same way: ours with the blocking no-op
#: engine against the peer's hop per write, and both sides over the real Mooncake engine.
LIKE_FOR_LIKE_GOALS = {1: 1.5, 64: 2.0}


def _ms(summary: dict[str, Any]) -> str:
    latency = summary["latency"]
    return f"{latency['p50_ms']:.2f} / {latency['p99_ms']:.2f}"


def _runs(summary: dict[str, Any]) -> str:
    return " ".join(f"{rate:,.0f}" for rate in summary["runs_per_s"])


def table(cells: list[dict[str, Any]]) -> str:
    """Each cell's no-op engine rows: SGLang, ours, ours with the blocking engine."""
    lines = [
        "| c | ours on | peer /s (runs) | ours /s (runs) | ours/peer | "
        "ours, blocking engine /s (runs) | blocking/peer | peer p50/p99 ms | "
        "ours p50/p99 ms | blocking p50/p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        peer, ours, slow = cell["peer"], cell["ours"], cell["ours_blocking"]
        if "ours_over_base" in cell:
            # Beside the baseline checkout: how the cells moved.
            ours_note = f" ({cell['ours_over_base']['median']:.2f}x base)"
            slow_note = f" ({cell['ours_blocking_over_base']['median']:.2f}x base)"
        else:
            ours_note = slow_note = ""
        lines.append(
            f"| {cell['concurrency']} | {cell['backend']} | "
            f"{peer['median_per_s']:,.0f} ({_runs(peer)}) | "
            f"{ours['median_per_s']:,.0f} ({_runs(ours)}) | "
            f"{cell['ours_over_peer']['median']:.2f}x{ours_note} | "
            f"{slow['median_per_s']:,.0f} ({_runs(slow)}) | "
            f"{cell['ours_blocking_over_peer']['median']:.2f}x{slow_note} | "
            f"{_ms(peer)} | {_ms(ours)} | {_ms(slow)} |"
        )
    return "\n".join(lines)


def mooncake_table(cells: list[dict[str, Any]]) -> str:
    """Each cell's real-Mooncake rows (cells without them are left out)."""
    lines = [
        "| c | ours on | peer, Mooncake /s (runs) | ours, Mooncake /s (runs) | ours/peer | "
        "peer p50/p99 ms | ours p50/p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        if "ours_mooncake" not in cell:
            continue
        peer, ours = cell["peer_mooncake"], cell["ours_mooncake"]
        lines.append(
            f"| {cell['concurrency']} | {cell['backend']} | "
            f"{peer['median_per_s']:,.0f} ({_runs(peer)}) | "
            f"{ours['median_per_s']:,.0f} ({_runs(ours)}) | "
            f"{cell['ours_mooncake_over_peer_mooncake']['median']:.2f}x | "
            f"{_ms(peer)} | {_ms(ours)} |"
        )
    return "\n".join(lines)


def _headline(
    cell: dict[str, Any], what: str, ours: str, peer: str, goals: dict[int, float]
) -> dict[str, Any]:
    goal = goals[cell["concurrency"]]
    ratio = cell[f"{ours}_over_{peer}"]["median"]
    return headline(
        f"{what} vs SGLang 0.5.20, c={cell['concurrency']}, ours on {cell['backend']}",
        ratio,
        "x",
        goal=f">= {goal}x",
        met=ratio >= goal,
        note=(
            f"ours {cell[ours]['median_per_s']:,.0f}/s vs peer "
            f"{cell[peer]['median_per_s']:,.0f}/s; p99 "
            f"{cell[ours]['latency']['p99_ms']:.2f} vs "
            f"{cell[peer]['latency']['p99_ms']:.2f} ms"
        ),
    )


def headlines(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: ours, the blocking engine and the Mooncake cell, each against its goal."""
    rows = []
    for cell in cells:
        rows.append(_headline(cell, "lifecycle", "ours", "peer", GOALS))
        rows.append(
            _headline(
                cell, "lifecycle, blocking engine", "ours_blocking", "peer", LIKE_FOR_LIKE_GOALS
            )
        )
        if "ours_mooncake" in cell:
            rows.append(
                _headline(
                    cell,
                    "lifecycle, both over Mooncake TCP",
                    "ours_mooncake",
                    "peer_mooncake",
                    LIKE_FOR_LIKE_GOALS,
                )
            )
    return rows


#: The plot's bars: (key of the ratio in a cell, colour, legend label, goals).
_BARS = (
    ("ours_over_peer", "#3b75af", "no-op engine, blocking = False", GOALS),
    ("ours_blocking_over_peer", "#e1812c", "no-op engine, blocking = True", LIKE_FOR_LIKE_GOALS),
    (
        "ours_mooncake_over_peer_mooncake",
        "#3a923a",
        "both over Mooncake TCP",
        LIKE_FOR_LIKE_GOALS,
    ),
)


def plot(options: Options, name: str, cells: list[dict[str, Any]]) -> None:
    """Every ours/peer ratio of every cell, beside its goal, as ``<name>.png``."""
    bars = [bar for bar in _BARS if all(bar[0] in cell for cell in cells)]

    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        labels = [f"c={cell['concurrency']}\n{cell['backend']}" for cell in cells]
        xs = list(range(len(cells)))
        width = 0.8 / len(bars)
        for index, (key, color, label, goals) in enumerate(bars):
            offset = (index - (len(bars) - 1) / 2) * width
            values = [cell[key]["median"] for cell in cells]
            ax.bar([x + offset for x in xs], values, width, color=color, label=label)
            for x, cell in zip(xs, cells, strict=True):
                goal = goals[cell["concurrency"]]
                ax.plot([x + offset - width / 2, x + offset + width / 2], [goal, goal], "k--", lw=1)
        ax.axhline(1.0, color="#999999", lw=1, ls=":")
        ax.set_xticks(xs, labels)
        ax.set_ylabel("ours / SGLang lifecycles per s (median of pairs)")
        ax.set_title("encode + send + release against SGLang 0.5.20 (dashed: goal)")
        ax.legend(fontsize=8)

    write_png(options, name, draw, size=(8, 4.2))

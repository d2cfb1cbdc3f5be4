"""What the judgements say: counts per annotator, agreement on the overlap (raw and Cohen's kappa), the blind human
win rate of compare mode with its Wilson interval, and the alarm when a reward model disagrees with people.

The math is in pure functions of labels and counts; `plot_figures` draws them."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from rlhfkit.evaluation.metrics import wilson_interval
from rlhfkit.label.store import Judgement

# "both bad" says neither response is better: for a win rate it is a tie.
_TIES = ("tie", "both_bad")
# In compare mode the pair's first response is the compared model's, the second the reference's.
_LEGEND = {"first": "first preferred (compare: the model)", "second": "second preferred (compare: the reference)",
           "tie": "tie", "both_bad": "both bad", "skip": "skip"}


def cohen_kappa(a: Sequence[str], b: Sequence[str]) -> float | None:
    """Cohen's kappa (Cohen 1960) of two raters' labels of the same items: (p_o - p_e) / (1 - p_e), p_o the share of
    items they label alike, p_e the share expected by chance from each rater's own label frequencies. None when
    undefined (no items, or p_e = 1: both raters used one and the same label throughout)."""
    if len(a) != len(b):
        raise ValueError(f"cohen_kappa needs paired labels, got {len(a)} and {len(b)}")
    n = len(a)
    if n == 0:
        return None
    p_o = sum(x == y for x, y in zip(a, b)) / n
    ca, cb = Counter(a), Counter(b)
    p_e = sum(ca[c] * cb[c] for c in ca) / (n * n)
    return None if p_e == 1 else (p_o - p_e) / (1 - p_e)


@dataclass(frozen=True)
class Agreement:
    items: int  # overlap items judged by two annotators (skips left out)
    raw: float | None  # share judged alike
    kappa: float | None


def overlap_labels(judgements: Sequence[Judgement]) -> tuple[list[str], list[str]]:
    """The two labels of each item judged by two annotators (first-come first), skips left out."""
    by_item: dict[int, list[str]] = defaultdict(list)
    for j in judgements:
        if j.choice != "skip":
            by_item[j.item].append(j.choice)
    twice = [labels for labels in by_item.values() if len(labels) == 2]
    return [x for x, _ in twice], [y for _, y in twice]


def agreement(judgements: Sequence[Judgement]) -> Agreement:
    a, b = overlap_labels(judgements)
    raw = sum(x == y for x, y in zip(a, b)) / len(a) if a else None
    return Agreement(len(a), raw, cohen_kappa(a, b))


def per_annotator(judgements: Sequence[Judgement]) -> dict[str, dict[str, int]]:
    """annotator -> choice -> count."""
    out: dict[str, Counter] = defaultdict(Counter)
    for j in judgements:
        out[j.annotator][j.choice] += 1
    return {who: dict(c) for who, c in sorted(out.items())}


@dataclass(frozen=True)
class HumanWinRate:
    """How often people preferred `model` over `reference` (compare mode); ties and "both bad" count half."""

    model: str
    reference: str
    n: int  # judgements, skips left out
    wins: int
    losses: int
    ties: int  # ties and "both bad"
    win_rate: float | None
    interval: tuple[float, float]  # 95% Wilson score interval of win_rate
    tie_rate: float | None


def human_win_rate(judgements: Sequence[Judgement]) -> HumanWinRate:
    """The first model's win rate over the second's (`Pair.first` is the compared model in compare mode)."""
    judged = [j for j in judgements if j.choice != "skip"]
    if not judged:
        raise ValueError("no judgements (other than skips) to compute a win rate from")
    model, reference = judged[0].pair.first.model, judged[0].pair.second.model
    counts = Counter(j.choice for j in judged)
    wins, losses, ties = counts["first"], counts["second"], sum(counts[c] for c in _TIES)
    n = len(judged)
    score = wins + 0.5 * ties
    return HumanWinRate(model, reference, n, wins, losses, ties, score / n, wilson_interval(score, n), ties / n)


def reward_disagrees(human: HumanWinRate, reward_win_rate: float | None) -> str | None:
    """The alarm: the reward model prefers the model's responses (its win rate on the same pairs above 1/2) while
    people prefer the reference's (human win rate below 1/2): a sign of reward hacking. None when they agree."""
    if reward_win_rate is None or human.win_rate is None:
        return None
    if reward_win_rate > 0.5 and human.win_rate < 0.5:
        sure = "its 95% interval lies below 1/2" if human.interval[1] < 0.5 else "its 95% interval still reaches 1/2"
        return (f"the reward model prefers {human.model} (win rate {reward_win_rate:.3f} on the same pairs) but people "
                f"prefer {human.reference} (human win rate {human.win_rate:.3f}; {sure}): the policy may be hacking the reward")
    return None


def plot_figures(counts: dict[str, dict[str, int]], agree: Agreement, path: str,
                 rm_accuracy: float | None = None) -> str:
    """A PNG: judgements per annotator by choice (stacked bars), with agreement and RM accuracy in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    choices = ("first", "second", "tie", "both_bad", "skip")
    names = list(counts) or ["(none)"]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(names) + 2), 3.5))
    bottom = [0] * len(names)
    for choice in choices:
        values = [counts.get(n, {}).get(choice, 0) for n in names]
        ax.bar(names, values, bottom=bottom, label=_LEGEND[choice])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("judgements")
    title = f"overlap: {agree.items} items"
    if agree.raw is not None:
        title += f", agreement {agree.raw:.2f}" + (f", Cohen's κ {agree.kappa:.2f}" if agree.kappa is not None else "")
    if rm_accuracy is not None:
        title += f"\nreward model agrees with people on {rm_accuracy:.0%} of pairs"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

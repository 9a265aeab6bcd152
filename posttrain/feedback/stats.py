"""How far labellers agree, and what a blind A/B comparison says: ``posttrain label stats TASK [--json]``.

Agreement is measured on the items judged by two labellers or more (the task's overlap share):

    rank     mean pairwise Kendall's tau-b (Kendall 1945) and Kendall's W (Kendall & Babington Smith 1939)
    pair     Cohen's kappa per pair of labellers (Cohen 1960), Fleiss' kappa over all (Fleiss 1971)
    compare  the same kappas on the winner; the win rate of A with a Wilson interval (Wilson 1927); the
             position bias (share of decisive choices that went to the left side)
    score    Krippendorff's alpha, interval metric (Krippendorff 2011), and the tau-b of the rankings the
             scores imply, so that the claim "rankings agree better than scores" can be measured

The formulas are written out in each function's docstring and in docs/human_feedback.md. A statistic
that is undefined (no shared item, no variation) is NaN here and null in stats.json.

What the command line calls (``posttrain label stats``, ``posttrain report``):

    label_stats(task_dir, as_json=False) -> str     the text to print; writes TASK/stats.json
    summarize(task) -> dict;  write_stats(task) -> dict;  format_stats(stats) -> str
    refresh_stats(run_dirs, tasks) -> {folder: why}   rewrites the stats.json files posttrain report reads
"""

from __future__ import annotations

import json
import math
from collections import Counter
from itertools import combinations
from pathlib import Path

from posttrain.errors import UserError
from posttrain.feedback.store import SETTINGS, TaskFolder, load_task, write_atomically

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile
STATS = "stats.json"

# --------------------------------------------------------------------------------------------------
# the statistics
# --------------------------------------------------------------------------------------------------


def midranks(ranking: list[list[int]]) -> dict[int, float]:
    """candidate -> rank (1 = best) of a ranking given as groups best first; a tied group shares the mean of
    the ranks it spans ([[2], [0, 3], [1]] -> {2: 1, 0: 2.5, 3: 2.5, 1: 4})."""
    ranks, start = {}, 1
    for group in ranking:
        for candidate in group:
            ranks[candidate] = start + (len(group) - 1) / 2
        start += len(group)
    return ranks


def kendall_tau_b(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b of two rankings of the same n objects (Kendall 1938, Biometrika 30; ties: Kendall
    1945, "The treatment of ties in ranking problems", Biometrika 33):

        tau_b = (n_c - n_d) / sqrt((n_0 - n_1) (n_0 - n_2))

    n_c / n_d: pairs of objects ordered alike / oppositely by x and y (a pair tied in either counts in
    neither), n_0 = n(n-1)/2, n_1 = sum over x's tied groups of t(t-1)/2, n_2 the same for y. 1 = the same
    order, -1 = reversed; NaN when a ranking ties everything."""
    if len(x) != len(y):
        raise ValueError(f"two rankings of different lengths ({len(x)}, {len(y)})")
    concordant = discordant = ties_x = ties_y = 0
    for i, j in combinations(range(len(x)), 2):
        dx, dy = x[i] - x[j], y[i] - y[j]
        ties_x += dx == 0
        ties_y += dy == 0
        if dx * dy > 0:
            concordant += 1
        elif dx * dy < 0:
            discordant += 1
    n0 = len(x) * (len(x) - 1) / 2
    denominator = math.sqrt((n0 - ties_x) * (n0 - ties_y))
    return (concordant - discordant) / denominator if denominator > 0 else math.nan


def kendall_w(ranks: list[list[float]]) -> float:
    """Kendall's coefficient of concordance of m rankings of n objects (Kendall & Babington Smith 1939,
    Ann. Math. Statist. 10; tie correction: Kendall 1948, Rank Correlation Methods, §6):

        W = 12 S / (m^2 (n^3 - n) - m sum_j T_j),   S = sum_i (R_i - m(n+1)/2)^2,   T_j = sum (t^3 - t)

    ``ranks``: m lists of n mid-ranks (1..n, tied objects sharing the mean rank); R_i = the rank sum of
    object i; T_j runs over the tied groups (of size t) of ranking j. 1 = every ranking the same, 0 = no
    concordance; NaN when every ranking ties everything."""
    m, n = len(ranks), len(ranks[0])
    sums = [sum(r[i] for r in ranks) for i in range(n)]
    s = sum((total - m * (n + 1) / 2) ** 2 for total in sums)
    ties = sum(t**3 - t for r in ranks for t in Counter(r).values())
    denominator = m**2 * (n**3 - n) - m * ties
    return 12 * s / denominator if denominator > 0 else math.nan


def cohen_kappa(a: list, b: list) -> float:
    """Cohen's kappa of two labellers' categories on the same items (Cohen 1960, Educ. Psychol. Meas. 20):

        kappa = (p_o - p_e) / (1 - p_e),   p_e = sum_c p_a(c) p_b(c)

    p_o: the share of items on which they agree; p_a(c), p_b(c): the share of items each put in category c.
    1 = full agreement, 0 = as much as chance; NaN when both always choose one and the same category."""
    if len(a) != len(b) or not a:
        raise ValueError("Cohen's kappa needs two equally long, non-empty lists of categories")
    n = len(a)
    observed = sum(x == y for x, y in zip(a, b, strict=True)) / n
    count_a, count_b = Counter(a), Counter(b)
    expected = sum(count_a[c] * count_b[c] for c in count_a) / n**2
    return (observed - expected) / (1 - expected) if expected < 1 else math.nan


def fleiss_kappa(counts: list[list[int]]) -> float:
    """Fleiss' kappa of many labellers (Fleiss 1971, Psychol. Bull. 76), in the form that lets the number
    of labellers n_i differ between items (each n_i >= 2):

        kappa = (P_bar - P_e) / (1 - P_e),   P_i = (sum_j n_ij^2 - n_i) / (n_i (n_i - 1)),
        P_bar = mean_i P_i,   P_e = sum_j p_j^2,   p_j = sum_i n_ij / sum_i n_i

    ``counts``: one row per item, n_ij = how many labellers put item i in category j. With the same n for
    every item this is Fleiss' formula; 1 = full agreement, 0 = chance; NaN when one category takes all."""
    rows = [row for row in counts if sum(row) >= 2]
    if not rows:
        return math.nan
    p_bar = sum((sum(c * c for c in row) - sum(row)) / (sum(row) * (sum(row) - 1)) for row in rows) / len(rows)
    total = sum(sum(row) for row in rows)
    p_e = sum((sum(row[j] for row in rows) / total) ** 2 for j in range(len(rows[0])))
    return (p_bar - p_e) / (1 - p_e) if p_e < 1 else math.nan


def krippendorff_alpha_interval(units: list[list[float]]) -> float:
    """Krippendorff's alpha with the interval metric (Krippendorff 2011, "Computing Krippendorff's
    alpha-reliability", Annenberg School for Communication, departmental paper 43):

        alpha = 1 - D_o / D_e
        D_o = (1/n) sum_u 1/(m_u - 1) sum_{i != j in u} (v_ui - v_uj)^2
        D_e = 1/(n (n - 1)) sum_{i != j over all pairable values} (v_i - v_j)^2

    ``units``: the values given to each unit (an item's candidate), any number of labellers per unit
    (missing data allowed); a unit with fewer than two values is not pairable and drops out; n = the
    number of pairable values. 1 = perfect reliability, 0 = chance; NaN when every value is the same."""
    pairable = [u for u in units if len(u) >= 2]
    values = [v for u in pairable for v in u]
    n = len(values)
    if n < 2:
        return math.nan
    within = sum(_squared_differences(u) / (len(u) - 1) for u in pairable)
    expected = _squared_differences(values) / (n - 1)
    return 1 - within / expected if expected > 0 else math.nan


def _squared_differences(values: list[float]) -> float:
    """sum over ordered pairs i != j of (v_i - v_j)^2 = 2 (n sum v^2 - (sum v)^2)."""
    return 2 * (len(values) * sum(v * v for v in values) - sum(values) ** 2)


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion (Wilson 1927, J. Am. Stat. Assoc. 22):

        (p + z^2/(2n) -+ z sqrt(p(1-p)/n + z^2/(4n^2))) / (1 + z^2/n),   p = successes / n

    z = 1.96 for 95 %. Unlike p -+ z sqrt(p(1-p)/n) it stays inside [0, 1] and is not empty at p = 0 or 1.
    ``successes`` may be fractional (a tie counted as half). (NaN, NaN) when n = 0."""
    if n == 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def compare_summary(judgements: list[dict]) -> dict:
    """A blind A/B comparison from compare judgements ({"winner": "A"|"B"|"tie", "left": "A"|"B"}):

    win_rate: (wins_A + ties/2) / n with its Wilson interval; win_rate_decisive: wins_A / (wins_A + wins_B)
    with its interval (ties left out); tie_share = ties / n; position bias: left_share = the share of
    decisive choices that went to the side shown on the left, with its interval, ``position_bias`` true
    when that interval leaves out 1/2 (the labeller's side, not the answers, decided)."""
    wins_a = sum(j["winner"] == "A" for j in judgements)
    wins_b = sum(j["winner"] == "B" for j in judgements)
    ties, n = len(judgements) - wins_a - wins_b, len(judgements)
    decisive = wins_a + wins_b
    left = sum(j["winner"] == j["left"] for j in judgements)
    left_interval = wilson_interval(left, decisive)
    return {
        "n": n,
        "wins_A": wins_a,
        "wins_B": wins_b,
        "ties": ties,
        "win_rate": (wins_a + ties / 2) / n if n else math.nan,
        "win_rate_ci": wilson_interval(wins_a + ties / 2, n),
        "win_rate_decisive": wins_a / decisive if decisive else math.nan,
        "win_rate_decisive_ci": wilson_interval(wins_a, decisive),
        "tie_share": ties / n if n else math.nan,
        "left_share": left / decisive if decisive else math.nan,
        "left_share_ci": left_interval,
        "position_bias": bool(decisive) and not left_interval[0] <= 0.5 <= left_interval[1],
    }


# --------------------------------------------------------------------------------------------------
# a task's statistics
# --------------------------------------------------------------------------------------------------


def _shared(judgements: list[dict]) -> dict[str, dict[str, dict]]:
    """item -> labeller -> judgement, for the items judged by two labellers or more."""
    by_item: dict[str, dict[str, dict]] = {}
    for j in judgements:
        by_item.setdefault(j["item"], {})[j["labeller"]] = j
    return {item: who for item, who in by_item.items() if len(who) >= 2}


def _ranks(judgement: dict) -> list[float]:
    """A rank or score judgement as mid-ranks of its candidates in index order (scores: higher = better)."""
    if "scores" in judgement:
        scores = {int(i): s for i, s in judgement["scores"].items()}
        groups = [[i for i in scores if scores[i] == s] for s in sorted(set(scores.values()), reverse=True)]
    else:
        groups = judgement["ranking"]
    ranks = midranks(groups)
    return [ranks[i] for i in sorted(ranks)]


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def rank_agreement(shared: dict[str, dict[str, dict]]) -> dict:
    """Mean pairwise Kendall's tau-b over (shared item, pair of its labellers), per pair of labellers,
    and Kendall's W averaged over the shared items (each item's W over the labellers who ranked it)."""
    per_pair: dict[str, list[float]] = {}
    for who in shared.values():
        for a, b in combinations(sorted(who), 2):
            per_pair.setdefault(f"{a}~{b}", []).append(kendall_tau_b(_ranks(who[a]), _ranks(who[b])))
    taus = [t for values in per_pair.values() for t in values]
    return {
        "items": len(shared),
        "kendall_tau_b": _mean(taus),
        "kendall_tau_b_by_pair": {pair: _mean(values) for pair, values in sorted(per_pair.items())},
        "kendall_w": _mean([kendall_w([_ranks(j) for j in who.values()]) for who in shared.values()]),
    }


def _category(judgement: dict) -> str:
    """What a pair or compare judgement chose: compare: the winner; pair: "first" / "second" (the lower /
    higher candidate index of the two shown: the same two for every labeller of the item) or "tie"."""
    if judgement["mode"] == "compare":
        return judgement["winner"]
    if judgement.get("tie"):
        return "tie"
    return "first" if judgement["chosen"] < judgement["rejected"] else "second"


def category_agreement(shared: dict[str, dict[str, dict]]) -> dict:
    """Cohen's kappa for each pair of labellers on the items both judged; Fleiss' kappa over all."""
    categories = sorted({_category(j) for who in shared.values() for j in who.values()})
    counts = [[Counter(map(_category, who.values()))[c] for c in categories] for who in shared.values()]
    names = sorted({name for who in shared.values() for name in who})
    cohen = {}
    for a, b in combinations(names, 2):
        both = [who for who in shared.values() if a in who and b in who]
        if both:
            cohen[f"{a}~{b}"] = cohen_kappa([_category(w[a]) for w in both], [_category(w[b]) for w in both])
    return {"items": len(shared), "fleiss_kappa": fleiss_kappa(counts) if counts else math.nan, "cohen_kappa": cohen}


def score_agreement(shared: dict[str, dict[str, dict]]) -> dict:
    """Krippendorff's alpha (interval) over the units (item, candidate), and the rank agreement of the
    rankings the scores imply (equal scores tie)."""
    units = [
        [j["scores"][key] for j in who.values()]
        for who in shared.values()
        for key in next(iter(who.values()))["scores"]
    ]
    implied = rank_agreement(shared)
    return {
        "items": len(shared),
        "krippendorff_alpha": krippendorff_alpha_interval(units),
        "kendall_tau_b_of_scores": implied["kendall_tau_b"],
        "kendall_w_of_scores": implied["kendall_w"],
    }


def summarize(task: TaskFolder) -> dict:
    """Everything ``posttrain label stats`` shows, as a JSON-ready dict (undefined numbers are None)."""
    state = task.state()
    names = sorted(set(task.labellers) | set(state.by_labeller))
    labellers = {}
    for name in names:
        events = state.by_labeller.get(name, [])
        labellers[name] = {
            "judgements": sum(e["event"] == "judgement" for e in events),
            "skips": sum(e.get("reason") == "skip" for e in events),
            "flags": sum(e.get("reason") == "flag" for e in events),
            # None: a name the log holds but task.json does not list (labelled with posttrain label --labellers)
            "assigned": len(task.assigned(name)) if not task.labellers or name in task.labellers else None,
        }
    judgements = state.judgements()
    mode = labelled_mode(task, judgements)
    shared = _shared(judgements)
    agreement = {"rank": rank_agreement, "pair": category_agreement, "compare": category_agreement}
    stats = {
        "task": str(task.path),
        "mode": mode,
        "models": task.models,
        "items": len(task.items),
        "judgements": len(judgements),
        "skips": sum(v["skips"] for v in labellers.values()),
        "flags": sum(v["flags"] for v in labellers.values()),
        "torn_lines": state.torn,
        "labellers": labellers,
        "agreement": agreement.get(mode, score_agreement)(shared),
    }
    if mode == "compare":
        stats["compare"] = compare_summary(judgements)
        stats["compare_by_labeller"] = {
            name: compare_summary([j for j in judgements if j["labeller"] == name]) for name in names
        }
    return _json_ready(stats)


def labelled_mode(task: TaskFolder, judgements: list[dict]) -> str:
    """The mode ``judgements`` (the live ones of ``task``'s log) were made in: ``posttrain label --mode`` may
    differ from task.json's, and the store keeps one per log; task.json's before any judgement."""
    modes = sorted({str(j.get("mode")) for j in judgements})
    if len(modes) > 1:
        raise UserError(f"{task.log_path}: judgements in {' and '.join(modes)} mode; one mode per task folder")
    return modes[0] if modes else task.mode


def _json_ready(value):
    """NaN -> None (JSON has no NaN), tuples -> lists."""
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def write_stats(task: TaskFolder) -> dict:
    """``summarize(task)``, also written to TASK/stats.json (through a temporary file, fsync'd, and a rename)."""
    stats = summarize(task)
    write_atomically(task.path / STATS, json.dumps(stats, indent=1) + "\n")
    return stats


def label_stats(task_dir: str | Path, as_json: bool = False) -> str:
    """``posttrain label stats TASK [--json]``: the text to print (a table, or the JSON); writes TASK/stats.json."""
    stats = write_stats(load_task(task_dir))
    return json.dumps(stats, indent=1) if as_json else format_stats(stats)


def _num(value, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _interval(value, ci) -> str:
    return f"{_num(value)} [{_num(ci[0])}, {_num(ci[1])}]"


AGREEMENT_NAMES = {
    "kendall_tau_b": "mean pairwise Kendall's tau-b",
    "kendall_w": "Kendall's W (mean over items)",
    "fleiss_kappa": "Fleiss' kappa",
    "krippendorff_alpha": "Krippendorff's alpha (interval)",
    "kendall_tau_b_of_scores": "Kendall's tau-b of the rankings the scores imply",
    "kendall_w_of_scores": "Kendall's W of those rankings",
}


def format_stats(stats: dict) -> str:
    """The table ``posttrain label stats`` prints."""
    torn = f", {stats['torn_lines']} torn log lines skipped" if stats["torn_lines"] else ""
    lines = [
        f"task {stats['task']}: {stats['mode']} mode, {stats['items']} items, {stats['judgements']} judgements, "
        f"{stats['skips']} skips, {stats['flags']} flags{torn}",
        f"{'labeller':<20}{'judgements':>12}{'skips':>8}{'flags':>8}{'assigned':>10}",
    ]
    for name, row in stats["labellers"].items():
        assigned = "—" if row["assigned"] is None else row["assigned"]
        lines.append(f"{name:<20}{row['judgements']:>12}{row['skips']:>8}{row['flags']:>8}{assigned:>10}")
    agreement = stats["agreement"]
    lines.append(f"agreement on the {agreement['items']} items judged by two labellers or more:")
    for key, name in AGREEMENT_NAMES.items():
        if key in agreement:
            lines.append(f"  {name:<50}{_num(agreement[key])}")
    for key, label in (("kendall_tau_b_by_pair", "tau-b"), ("cohen_kappa", "Cohen's kappa")):
        for pair, value in agreement.get(key, {}).items():
            lines.append(f"  {label + ' ' + pair:<50}{_num(value)}")
    if "compare" in stats:
        models = stats["models"]
        lines.append(f"A = {models.get('A')}, B = {models.get('B')} (95 % Wilson intervals)")
        for name, summary in [("all", stats["compare"]), *stats["compare_by_labeller"].items()]:
            lines += _compare_lines(name, summary)
    return "\n".join(lines)


def _compare_lines(name: str, c: dict) -> list[str]:
    bias = "  POSITION BIAS: the side decided more than the answers" if c["position_bias"] else ""
    return [
        f"  {name}: n = {c['n']}, A {c['wins_A']}, B {c['wins_B']}, ties {c['ties']} (share {_num(c['tie_share'])})",
        f"    win rate of A, ties as half   {_interval(c['win_rate'], c['win_rate_ci'])}",
        f"    win rate of A, without ties  {_interval(c['win_rate_decisive'], c['win_rate_decisive_ci'])}",
        f"    left side's share of wins    {_interval(c['left_share'], c['left_share_ci'])}{bias}",
    ]


def refresh_stats(run_dirs: list[str | Path], tasks: list[str | Path] = ()) -> dict[Path, str]:
    """Rewrite stats.json of each task folder ``posttrain report`` reads (``tasks`` and every
    ``<run>/human/*/`` holding a task.json), so that it shows the judgements made since. Returns the run
    folders' tasks that could not be read, each with its one-line reason: one broken task does not stop the
    report of the training run (a task named in ``tasks`` does: it was asked for)."""
    folders = [p for run in run_dirs for p in sorted((Path(run) / "human").glob("*")) if (p / SETTINGS).is_file()]
    unreadable = {}
    for folder in folders:
        try:
            write_stats(load_task(folder))
        except (UserError, OSError) as err:
            unreadable[folder] = str(err)
    for folder in tasks:
        write_stats(load_task(folder))
    return unreadable

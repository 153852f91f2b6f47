"""The one page a cache-store maintainer reads first (``results/SUMMARY.md``), printed from committed rows.

Every number is computed here from the per-question rows the long-context study committed
(``results/long_context_<model>.csv``), the puzzle study's
(``results/merge_puzzle_smollm2-135m.csv``), the haystack study's
(``results/haystack_<model>.csv``, and ``haystack_8x512_<model>.csv`` at 8 x 512), the
recompute-window study's (``results/recompute_window*_gemma3-270m.csv``), the naive-dose sweep's
(``results/naive_dose/rows_<model>.csv``), the order arm's
(``results/order_nearness/rows_<model>.csv``) and the needle study's
(``results/needle/rows_<model>.csv``, with their designs), with kvlab's cluster bootstrap over
caches; nothing is typed in. ``studies/summary.py`` writes the page, and a test checks the
committed page is what :func:`render` prints.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvlab.findings import haystack_table, needle_table, order_table
from kvlab.findings import puzzle as puzzle_rows
from kvlab.findings.curve import r90
from kvlab.findings.design import load_design
from kvlab.findings.longctx import cache_of, gap_closed, pairs
from kvlab.findings.rows import read_rows as read_study_rows
from kvlab.findings.strata import compare, merges, read_rows
from kvlab.measure.stats import fmt_ci, paired_diff_ci, proportion_ci

MODELS = {"smollm2-135m": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma 3 270M-it"}
#: Columns the order arm's and the needle study's rows keep as text (an answer "1893").
TEXT = ("answer", "truth", "ref_answer", "distractors")
SHORT = {"smollm2-135m": "SmolLM2", "gemma3-270m": "Gemma 3"}
RECOMPUTE = "recompute r=0.15"
HAY_EM = "{k} fragments, single, all: naive - rerotate exact match"
HAY_KL = "{k} fragments, single, all: naive - rerotate span KL"


def _rows(results: Path) -> dict[str, list[dict]]:
    return {m: merges(read_rows(results / f"long_context_{m}.csv")) for m in MODELS}


def _n(c) -> str:
    return f"{c.n_clusters} caches, {c.n} questions"


def _ceiling(rows: list[dict], k: int):
    ref = [r for r in rows if r["strategy"] == "reprefill" and r["n_fragments"] == k]
    return proportion_ci([bool(r["em"]) for r in ref], clusters=[cache_of(r) for r in ref])


#: The recompute curve's policies, in SUMMARY's order (results/recompute_curve/rows_<model>_<policy>.csv).
POLICIES_R90 = ("deviation", "fragment_start", "random_later")


def recompute_r90(results: Path, model: str, policy: str, seed: int = 0) -> dict:
    """r90 of one policy on one model, recomputed from its committed rows, with the top measured ratio (``top``).

    The ratios are read from the rows' strategy labels (``policy r=X``); the seed is the study's (0).
    """
    rows = read_rows(Path(results) / "recompute_curve" / f"rows_{model}_{policy}.csv")
    ratios = sorted({float(r["strategy"].split("r=")[1]) for r in rows if r["strategy"].startswith(policy + " r=")})
    return {**r90(rows, policy, ratios, seed), "top": ratios[-1]}


def _r90(x: dict) -> str:
    return f"{x['mean']:.2f} [{x['lo']:.2f}, {x['hi']:.2f}]"


def _counts(ks: list[int]) -> str:
    """``"4 and 8"``; ``"no tested count"`` when empty."""
    return " and ".join(map(str, ks)) or "no tested"


def render(results: str | Path) -> str:
    """The page's markdown, from ``results``' long-context rows."""
    results = Path(results)
    # The sweeps whose points commit no per-question rows (rows_<...>.csv beside their records).
    sweeps = ("recompute_curve", "gemma_controls", "finetune_dose")
    bare = [name for name in sweeps if not any((results / name).glob("rows_*.csv"))]
    rows = _rows(results)
    diff = {m: {(r["n_fragments"], r["stratum"], r["metric"]): r for r in compare(rs)} for m, rs in rows.items()}
    s, g = "smollm2-135m", "gemma3-270m"
    counts = sorted({r["n_fragments"] for r in rows[s]})
    k_max = counts[-1]
    ceil = {m: {k: _ceiling(rows[m], k) for k in counts} for m in MODELS}
    gap = {m: {k: gap_closed(rows[m], RECOMPUTE, "rerotate", where={"n_fragments": k}) for k in counts} for m in MODELS}

    def d(m, k, stratum, metric, spec):
        r = diff[m][k, stratum, metric]
        return f"{fmt_ci(r['ci'], spec)} ({_n(r['ci'])}; Holm p {r['p_holm']:.3f})"

    # The counts at which rerotate's exact-match gain on SmolLM2 is resolved (Holm, 5%): the headline says only those.
    em_won = [
        k
        for k in (4, k_max)
        if diff[s][k, "pooled", "em"]["p_holm"] <= 0.05 and diff[s][k, "pooled", "em"]["ci"].mean < 0
    ]

    r90s = {(m, p): recompute_r90(results, m, p) for m in MODELS for p in POLICIES_R90}
    curve_top = max(x["top"] for x in r90s.values())
    r90_lo, r90_hi = min(x["lo"] for x in r90s.values()), max(x["hi"] for x in r90s.values())
    r_star_min = min(x["r_star_min"] for x in r90s.values())
    hay = {m: read_study_rows(results / f"haystack_{m}.csv", text=haystack_table.TEXT) for m in MODELS}
    hay_fam = {m: {r["label"]: r for r in haystack_table.family(rs)} for m, rs in hay.items()}
    hay_n = {m: len({r["set"] for r in rs}) for m, rs in hay.items()}
    hay_counts = sorted({r["n_fragments"] for r in hay[s]})
    hk = hay_counts[-1]
    hay_gap = {
        m: gap_closed(rs, RECOMPUTE, "rerotate", where={"n_fragments": hk, "layout": "single"}) for m, rs in hay.items()
    }
    hay_tokens = json.loads((results / f"haystack_{s}.json").read_text())["tokens"]
    # The same haystack design at the generated set's longest merge, 8 fragments of <=512 tokens.
    long = {
        m: read_study_rows(haystack_table.rows_path(results, m, (8,), 512), text=haystack_table.TEXT) for m in MODELS
    }
    long_fam = {m: {r["label"]: r for r in haystack_table.family(rs)} for m, rs in long.items()}
    long_n = {m: len({r["set"] for r in rs}) for m, rs in long.items()}
    # The recompute-window study: the same 2-fragment essay caches, deviation's selection against a random one.
    win = read_study_rows(results / f"recompute_window_{g}.csv", text=haystack_table.TEXT)
    win_d = {}
    for arm in (RECOMPUTE, "random_later r=0.15"):
        x, y, labels = pairs(win, arm, "rerotate", "span_kl", None, cluster=haystack_table.CLUSTER)
        win_d[arm] = paired_diff_ci(x, y, clusters=labels)
    # Its follow-ups at r = 0.05: deviation's picks past the later fragment's start, and a random draw at their places.
    for name, arm in (
        ("past_start", "deviation_past_start r=0.05"),
        ("place_matched", "random_at_deviation_places r=0.05"),
    ):
        follow = read_study_rows(results / f"recompute_window_{name}_{g}.csv", text=haystack_table.TEXT)
        x, y, labels = pairs(follow, arm, "rerotate", "span_kl", None, cluster=haystack_table.CLUSTER)
        win_d[arm] = paired_diff_ci(x, y, clusters=labels)
    picks = win_d["deviation_past_start r=0.05"], win_d["random_at_deviation_places r=0.05"]
    picks_say = (
        "it is the tokens `deviation` ranks first, not their place"
        if picks[0].lo > 0 and picks[1].hi <= 0
        else "the follow-ups do not tell the tokens `deviation` ranks first from their place"
    )

    def h(m, what, spec, k=None, fam=hay_fam):
        r = fam[m][what.format(k=k or hk)]
        return (
            f"{fmt_ci(r['ci'], spec)} ({r['ci'].n_clusters} haystacks, {r['ci'].n} questions; Holm p {r['p_holm']:.3f})"
        )

    def hay_em(rs: list[dict], k: int, strategy: str = "reprefill"):
        ref = [r for r in rs if r["strategy"] == strategy and r["layout"] == "single" and r["n_fragments"] == k]
        return fmt_ci(proportion_ci([r["em"] for r in ref], clusters=[r["set"] for r in ref]), ".2f")

    long_kl = long_fam[s][HAY_KL.format(k=8)]
    long_sign = (
        "naive stays closer to the joined prefill"
        if long_kl["p_holm"] <= 0.05 and long_kl["ci"].mean < 0
        else "rerotate is closer to the joined prefill there"
        if long_kl["p_holm"] <= 0.05
        else "neither is resolved closer"
    )

    findings = [
        (
            f"**A naive merge breaks Gemma 3 (sliding-window layers) at every count.** Exact match, naive − rerotate, "
            f"at 2 × 512: {d(g, 2, 'pooled', 'em', '+.2f')}; answer-span KL {d(g, 2, 'pooled', 'span_kl', '+.2f')} "
            f"nats/token; at {k_max} fragments exact match {d(g, k_max, 'pooled', 'em', '+.2f')}. On essays nobody "
            f"here wrote (the haystack study) the same, once the merge passes the window: at 4 × {hay_tokens} "
            f"{h(g, HAY_EM, '+.2f', 4)}.",
            "Never serve a naive (unshifted) merge to a model with sliding-window layers: re-rotate every fragment's "
            "keys to its landing positions, or prefill again.",
        ),
        (
            f"**Re-rotation answers more questions right on SmolLM2 at {_counts(em_won)} fragments.** Exact match, "
            f"naive − rerotate, at 4 fragments {d(s, 4, 'pooled', 'em', '+.2f')}; at {k_max} "
            f"{d(s, k_max, 'pooled', 'em', '+.2f')} (Holm over the {sum(k[2] == 'em' for k in diff[s])} "
            "exact-match comparisons of the strata family; an adjusted p above 0.05 is not resolved).",
            "Re-rotate keys when merging on full-attention models too; a naive merge is not a safe default.",
        ),
        (
            "**Recompute (r = 0.15) helps SmolLM2 most; on Gemma 3 past its window it helps little or not at all.** "
            f"Share of rerotate's answer-span KL removed at {k_max} fragments: SmolLM2 {fmt_ci(gap[s][k_max], '.0%')} "
            f"({_n(gap[s][k_max])}); Gemma 3 {fmt_ci(gap[g][k_max], '.0%')} ({_n(gap[g][k_max])}). On essays "
            f"at {hk} × {hay_tokens}: SmolLM2 {fmt_ci(hay_gap[s], '.0%')}, Gemma 3 {fmt_ci(hay_gap[g], '.0%')} "
            f"({hay_gap[s].n_clusters} haystacks, {hay_gap[s].n} questions each). Inside Gemma 3's window (essays, "
            f"2 × {hay_tokens}) the selection decides the sign: recompute − rerotate answer-span KL at r = 0.15 is "
            f"{fmt_ci(win_d[RECOMPUTE], '+.4f')} under `deviation` and {fmt_ci(win_d['random_later r=0.15'], '+.4f')} "
            f"under a random draw of the same later tokens ({_n(win_d[RECOMPUTE]).replace('caches', 'haystacks')}; "
            "[README.md](README.md#recompute-inside-gemma-3s-window-the-selection-not-the-mixture)). At r = 0.05 "
            f"{picks_say}: kept past the later fragment's start it is "
            f"{fmt_ci(picks[0], '+.4f')}, a random draw of as many tokens at its places {fmt_ci(picks[1], '+.4f')}.",
            "Measure the recompute ratio's benefit per model, against rerotate and against a random draw of the same "
            "budget, before paying for it; do not carry a ratio or a selection tuned on one architecture to another.",
        ),
        (
            f"**A pooled figure hides opposite effects by position.** SmolLM2, 2 × 512, exact match naive − rerotate: "
            f"pooled {d(s, 2, 'pooled', 'em', '+.2f')}; answer in passage 0 {d(s, 2, 'passage 0', 'em', '+.2f')}; "
            f"in passage 1 {d(s, 2, 'passage 1', 'em', '+.2f')}.",
            "A store's acceptance test must ask about every fragment of a merge, first and last, and report them "
            "apart; a pooled score can pass a merge that fails one position.",
        ),
        (
            "**The reference is often wrong.** The joined prefill (the exact answer a merge is scored against) "
            "answers right: SmolLM2 "
            + ", ".join(f"{k} fragments {fmt_ci(ceil[s][k], '.2f')}" for k in counts)
            + f" ({_n(ceil[s][k_max])} at {k_max}); Gemma 3 "
            + ", ".join(f"{k} fragments {fmt_ci(ceil[g][k], '.2f')}" for k in counts)
            + f". Where it is wrong, closeness to it is closeness to a wrong answer: at {k_max} fragments on SmolLM2, "
            f"naive − rerotate answer-span KL is {d(s, k_max, 'reference right', 'span_kl', '+.2f')} where the "
            f"reference is right and {d(s, k_max, 'reference wrong', 'span_kl', '+.2f')} where it is wrong.",
            "Score merges against the truth as well as against the joined prefill, and only where the joined prefill "
            "is right does a KL against it measure damage.",
        ),
    ]
    # naive_dose's count axis: naive - rerotate by relative position, counts pooled, resampled by set (its table's seed 0).
    dose_rows = {m: read_rows(results / "naive_dose" / f"rows_{m}.csv") for m in MODELS}
    dose_sets = {m: len({r["set"] for r in rs}) for m, rs in dose_rows.items()}
    dose_counts = sorted({r["n_fragments"] for r in dose_rows[s]})
    # Only what the line prints: SmolLM2's first and last passage, and Gemma 3's every position.
    dose = {}
    for m, where in [(s, "first"), (s, "last")] + [(g, w) for w in ("first", "early", "late", "last")]:
        x, y, labels = pairs(dose_rows[m], "naive", "rerotate", "span_kl", {"relative": where}, ("set",))
        dose[m, where] = paired_diff_ci(x, y, clusters=labels, seed=0)
    g_low = min((c for (m, _), c in dose.items() if m == g), key=lambda c: c.lo)
    g_dose = (
        f"on Gemma 3 naive is further from the joined prefill at every relative position (the lowest, {fmt_ci(g_low, '+.3f')})"
        if g_low.lo > 0
        else "on Gemma 3 naive is not further from the joined prefill at every relative position"
    )
    designs = results.parent / "studies" / "designs"
    order_design, needle_design = load_design(designs / "order_nearness.toml"), load_design(designs / "needle.toml")
    order_rows = {m: read_study_rows(results / "order_nearness" / f"rows_{m}.csv", text=TEXT) for m in MODELS}
    needle_rows = {m: read_study_rows(results / "needle" / f"rows_{m}.csv", text=TEXT) for m in MODELS}
    puzzle = diff[s][2, "pooled", "span_kl"]
    pz_all = read_study_rows(results / "merge_puzzle_smollm2-135m.csv")
    pz = {(c["n_fragments"], c["number"]): c for c in puzzle_rows.compare(pz_all)}
    pz_sets = len({r["set"] for r in pz_all})
    out = [
        "# kvlab findings on one page",
        "",
        "Printed by `studies/summary.py` from the per-question rows of `results/long_context_<model>.csv` (and, "
        "for the SmolLM2 puzzle, `results/merge_puzzle_smollm2-135m.csv`; for offset against order, "
        "`results/naive_dose/rows_<model>.csv` and `results/order_nearness/rows_<model>.csv`; for needles among "
        "distractors, `results/needle/rows_<model>.csv`); every "
        "interval is a 95% cluster bootstrap over caches (caches resampled with all their questions; "
        "[docs/statistics.md](../docs/statistics.md)), paired differences are paired over the same questions, and "
        "p-values are Holm-adjusted within their family (one per model and metric: every count × stratum). "
        "Count 1 is excluded. The details stay in [README.md](README.md).",
        "",
        "## Setup and its limits",
        "",
        "* **Two small models:** " + " and ".join(f"{v} (`{k}`)" for k, v in MODELS.items()) + ", on CPU. Nothing "
        "here is measured on a model of production size.",
        f"* **Generated text, and one external check:** the findings below rest on seeded passages of invented "
        f"people, towns, ships and years, {len(counts)} fragment counts ({', '.join(map(str, counts))}) of ≤512 "
        "tokens, 20 independent caches per count. The [haystack study](README.md#text-nobody-here-wrote-needles-in-"
        f"essays) reads text nobody here wrote: {hay_n[s]} haystacks of Paul Graham's essays per model (the text of "
        f"the field's needle-in-a-haystack tests), at {', '.join(map(str, hay_counts))} fragments of ≤{hay_tokens} tokens "
        f"and at 8 fragments of ≤512 (the generated set's longest merge; {long_n[s]} haystacks per model), with "
        "invented needles.",
        "* **A reference that is often wrong:** the joined prefill is the exact result a merge is compared with, "
        "and it answers many questions wrong (finding 5).",
        "* **One fine-tune run:** the foreign-reader and fine-tune dose findings rest on a single fine-tuning run.",
        *(
            [
                f"* **Summaries only for some sweeps:** {', '.join(bare)} committed summaries, not per-question "
                "rows, so their intervals are not recomputed here."
            ]
            if bare
            else []
        ),
        "",
        "## The strongest findings",
        "",
    ]
    for i, (text, action) in enumerate(findings, 1):
        out += [f"{i}. {text}", f"   *For a cache store:* {action}", ""]
    out += [
        "## Open questions",
        "",
        f"* **The SmolLM2 puzzle: the data support recency capture, not sinks.** At 2 × 512 a naive merge is "
        f"closer to the joined prefill than rerotate (answer-span KL {fmt_ci(puzzle['ci'], '+.3f')}, "
        f"{_n(puzzle['ci'])}). Experiments (a)-(c) ({pz_sets} sets; "
        "[README.md](README.md#settling-the-smollm2-puzzle-experiments-a-c)): reversing the passages' order moves "
        "rerotate's deficit with the place in the merge, not with the passage (questions about passage 0, "
        f"rerotate − naive in order minus reversed, {fmt_ci(pz[2, 3]['ci'], '+.2f')} at 2 fragments, "
        f"{fmt_ci(pz[8, 3]['ci'], '+.2f')} at 8); rerotate answers questions about an early fragment with the "
        "same kind of fact from the last fragment more often than naive "
        f"({fmt_ci(pz[2, 6]['ci'], '+.2f')} at 2, {fmt_ci(pz[8, 6]['ci'], '+.2f')} at 8); taking the later "
        "fragments' first tokens out changes the naive − rerotate gap by "
        f"{fmt_ci(pz[2, 1]['ci'], '+.3f')} at 2 and {fmt_ci(pz[8, 1]['ci'], '+.3f')} at 8. Open: why SmolLM2 "
        "is captured and Gemma 3 is not, and whether a larger model is.",
        f"* **Offset or order?** naive_dose asks every passage at every count "
        f"({', '.join(map(str, dose_counts))}; {dose_sets[s]} generated sets on SmolLM2, {dose_sets[g]} on Gemma 3). "
        "On SmolLM2 the same passage at the same offset changes the sign of naive − rerotate with its place in "
        "the merge (early: naive closer to the joined prefill; late and last: rerotate closer): counts pooled, "
        f"answer-span KL naive − rerotate is {fmt_ci(dose[s, 'first'], '+.3f')} on the first passage and "
        f"{fmt_ci(dose[s, 'last'], '+.3f')} on the last ({dose[s, 'last'].n_clusters} sets, "
        f"{dose[s, 'last'].n} questions), so its place in the merge, not its absolute offset, sets the sign "
        f"([README.md](README.md#the-dose-response-of-a-naive-merge); there its place is also its distance to the "
        f"question); {g_dose}. " + order_table.summary(order_rows, SHORT, order_design) + " Open: whether a larger "
        "model shows either.",
        "* **The recompute curve near r*.** The curve ends at r* = (N − L₀)/N, where every policy is the joined "
        "prefill, and is recomputed from committed rows ([README.md](README.md#the-recompute-curve)). Measured "
        f"up to r = {curve_top:g}, r90 (the ratio removing 90% of rerotate's answer-span KL, interpolated between "
        "measured ratios; 95% cluster interval, caches resampled with the curve and r*): "
        + "; ".join(
            f"{'SmolLM2' if m == s else 'Gemma 3'} ({r90s[m, POLICIES_R90[0]]['caches']} caches) "
            + ", ".join(f"{p} {_r90(r90s[m, p])}" for p in POLICIES_R90)
            for m in MODELS
        )
        + f". Every interval lies within [{r90_lo:.2f}, {r90_hi:.2f}], "
        + (f"below the smallest r* ({r_star_min:.2f})" if r90_hi < r_star_min else f"reaching r* ({r_star_min:.2f})")
        + ": on these small models a recompute that removes 90% recomputes nearly every token that can change. "
        "Open: whether a larger model's curve rises sooner.",
        f"* **Text nobody here wrote: how far it carries.** On essay haystacks (the needle-in-a-haystack text, "
        f"{hay_n[s]} haystacks per model) finding 1 holds, recompute helps SmolLM2 far more than Gemma 3 "
        f"(finding 3), and the SmolLM2 puzzle's sign holds: naive − "
        f"rerotate answer-span KL at {hk} × {hay_tokens} {h(s, HAY_KL, '+.3f')}, while exact match does not "
        f"separate them ({h(s, HAY_EM, '+.2f')}) "
        "([README.md](README.md#text-nobody-here-wrote-needles-in-essays)). At 8 × 512, the generated set's longest "
        f"merge, SmolLM2's joined prefill finds {hay_em(long[s], 8)} of the single needles (at {hk} × "
        f"{hay_tokens}: {hay_em(hay[s], hk)}) and {long_sign}: naive − rerotate answer-span KL "
        f"{h(s, HAY_KL, '+.3f', 8, long_fam)}; Gemma 3's naive merge finds "
        f"{hay_em(long[g], 8, 'naive')} of them (naive − rerotate, {h(g, HAY_EM, '+.2f', 8, long_fam)}). "
        + needle_table.summary(needle_rows, SHORT, needle_design)
        + " Open: a model of production size.",
        "",
    ]
    return "\n".join(out)

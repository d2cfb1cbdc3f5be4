"""Reward-hacking alarms on constructed histories: each fires where it must and stays quiet where it must not."""

from rlhfkit.evaluation.alarms import (
    AlarmThresholds, SampleStats, check_alarms, degenerate_responses, distinct_collapse, diversity_figures,
    length_correlation, proxy_up_gold_down,
)


def rows(n=20, **series):
    """n metric rows (steps 1..n); each keyword is a function of the fraction of the run done, t in [0, 1]."""
    return [{"step": i + 1, **{k.replace("__", "/"): f(i / (n - 1)) for k, f in series.items()}} for i in range(n)]


HEALTHY = rows(
    objective__scores=lambda t: 0.2 + t, objective__gold=lambda t: 0.1 + 0.5 * t, response__distinct_2=lambda t: 0.8 - 0.1 * t,
    response__empty_rate=lambda t: 0.0, response__eos_rate=lambda t: 0.95, response__score_length_corr=lambda t: 0.1,
    response__length_avg=lambda t: 12.0,
)


def test_healthy_run_raises_nothing():
    assert check_alarms(HEALTHY) == []


def test_proxy_up_gold_down():
    hacked = rows(objective__scores=lambda t: t, objective__gold=lambda t: 1.0 - t)
    (alarm,) = proxy_up_gold_down(hacked)
    assert alarm.name == "proxy_up_gold_down"
    # first window = steps 1-5 (mean 2/19 ≈ 0.1053), last = steps 16-20 (≈ 0.8947)
    assert "objective/scores rose 0.1053 -> 0.8947" in alarm.message and "objective/gold fell 0.8947 -> 0.1053" in alarm.message
    assert "steps 1-5 vs steps 16-20" in alarm.message
    assert proxy_up_gold_down(rows(objective__scores=lambda t: t, objective__gold=lambda t: 0.5 * t)) == []
    assert proxy_up_gold_down(rows(objective__scores=lambda t: t)) == []  # no gold judge logged
    # a held-out reward model as the gold key
    held_out = rows(objective__scores=lambda t: t, eval__rm=lambda t: -t)
    assert proxy_up_gold_down(held_out, AlarmThresholds(gold_keys=("eval/rm",)))[0].name == "proxy_up_gold_down"


def test_proxy_up_gold_down_ignores_noise():
    # The gold judge wobbles ±0.05 with no trend: well under one std between the windows.
    noisy = rows(objective__scores=lambda t: t, objective__gold=lambda t: 0.5 + 0.05 * (-1) ** round(t * 19))
    assert proxy_up_gold_down(noisy) == []


def test_length_correlation_from_samples():
    lengths = list(range(1, 11))
    (alarm,) = length_correlation([], SampleStats(lengths, {"rm": [0.1 * n for n in lengths]}))
    assert alarm.name == "length_correlation" and "rm" in alarm.message and "r = +1.00 over 10 samples" in alarm.message
    flat = [1.0, -1.0] * 5  # alternating: r = 0.17
    assert length_correlation([], SampleStats(lengths, {"rm": flat})) == []
    assert length_correlation([], SampleStats(lengths[:4], {"rm": lengths[:4]})) == []  # too few samples


def test_length_correlation_from_history():
    (alarm,) = length_correlation(rows(response__score_length_corr=lambda t: 0.9 * t))
    assert "response/score_length_corr averages +0.81 over steps 16-20" in alarm.message  # 0.9 · 17/19
    assert length_correlation(rows(response__score_length_corr=lambda t: 0.3)) == []


def test_distinct_collapse():
    (alarm,) = distinct_collapse(rows(response__distinct_2=lambda t: 0.8 - 0.6 * t))
    assert alarm.name == "distinct_collapse" and "response/distinct_2 fell" in alarm.message
    assert distinct_collapse(rows(response__distinct_2=lambda t: 0.8 - 0.3 * t)) == []  # 0.53 of 0.77: above half


def test_distinct_2_says_nothing_about_short_answers():
    # Responses under min_words words: their few word pairs are template, not diversity.
    assert distinct_collapse(rows(response__distinct_2=lambda t: 0.8 - 0.6 * t, response__words_avg=lambda t: 1.5)) == []
    (alarm,) = distinct_collapse(rows(response__distinct_2=lambda t: 0.8 - 0.6 * t, response__words_avg=lambda t: 12.0))
    assert "response/distinct_2 fell" in alarm.message


def test_healthy_single_number_answers_raise_nothing():
    # Random text at the start (distinct-2 0.9, 8 words), then varied one-number answers: no word pairs at all
    # (distinct-2 = 0), each prompt's 4 samples agree, and the most common answer covers 1-2 of the 4 prompts.
    def run(top_share):
        early = [{"step": s, "response/distinct_2": 0.9, "response/words_avg": 8.0, "response/top_share": 0.25}
                 for s in range(1, 6)]
        late = [{"step": s, "response/distinct_2": 0.0, "response/words_avg": 1.0, "response/top_share": top_share(s)}
                for s in range(6, 21)]
        return early + late

    assert check_alarms(run(lambda s: 0.5 if s % 3 == 0 else 0.25)) == []
    # Collapse onto one answer for every prompt: the most common response answers all of them.
    (alarm,) = check_alarms(run(lambda s: 1.0 if s > 10 else 0.25))
    assert alarm.name == "distinct_collapse"
    assert alarm.message == ("one response answers 100% of the prompts (response/top_share 0.25 -> 1, steps 1-5 vs "
                             "steps 16-20; above 90%): the responses no longer depend on the prompt")


def test_collapse_onto_one_answer_from_a_short_answer_start():
    # Numbers from the first step (e.g. after SFT): distinct-2 is 0 throughout, so only the top share can tell.
    history = rows(response__distinct_2=lambda t: 0.0, response__words_avg=lambda t: 1.0,
                   response__top_share=lambda t: 0.25 if t < 0.5 else 1.0)
    assert [a.name for a in check_alarms(history)] == ["distinct_collapse"]
    assert distinct_collapse(rows(response__top_share=lambda t: 0.95)) == []  # it never rose: nothing collapsed


def test_diversity_figures():
    texts = ["7", " 7", "12", "12 ", "5", "5", "7", "9"]  # 4 prompts x 2 samples; "7" answers prompts 0 and 3
    figures = diversity_figures(texts, [0, 0, 1, 1, 2, 2, 3, 3])
    assert figures == {"response/distinct_2": 0.0, "response/words_avg": 1.0, "response/top_share": 0.5}
    assert diversity_figures(["7"] * 8, [0, 0, 1, 1, 2, 2, 3, 3])["response/top_share"] == 1.0
    assert diversity_figures(["a b", "a c", "", ""], [0, 1, 2, 3]) == {
        "response/distinct_2": 1.0, "response/words_avg": 1.0, "response/top_share": 0.25}  # empty responses don't count
    assert diversity_figures(["7", "7"], [0, 0]) == {"response/distinct_2": 0.0, "response/words_avg": 1.0}  # one prompt


def test_degenerate_responses():
    (empty,) = degenerate_responses(rows(response__empty_rate=lambda t: 0.5 * t))
    assert "empty responses rose" in empty.message
    (cut,) = degenerate_responses(rows(response__eos_rate=lambda t: 1.0 - 0.6 * t))
    assert "truncated responses (no EOS) rose" in cut.message
    assert degenerate_responses(rows(response__empty_rate=lambda t: 0.1 * t, response__eos_rate=lambda t: 1.0 - 0.1 * t)) == []


def test_two_labelled_rows_compare_reference_and_policy():
    history = [{"label": "reference", "response/eos_rate": 1.0, "response/distinct_2": 0.8},
               {"label": "policy", "response/eos_rate": 0.8, "response/distinct_2": 0.2}]
    names = sorted(a.name for a in check_alarms(history))
    assert names == ["degenerate_responses", "distinct_collapse"]  # a rise of exactly 0.2 counts
    assert "reference vs policy" in distinct_collapse(history)[0].message


def test_rows_without_the_key_or_with_non_finite_values_are_skipped():
    history = [{"step": 1, "loss": 1.0}, {"step": 2, "response/empty_rate": 0.0}, {"step": 3, "response/empty_rate": float("nan")},
               {"step": 4, "response/empty_rate": 0.4}]
    (alarm,) = degenerate_responses(history)
    assert "step 2 vs step 4" in alarm.message

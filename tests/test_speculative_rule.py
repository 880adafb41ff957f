"""The acceptance rule and the K policy, on explicit distributions."""
from __future__ import annotations

import pytest
import torch

from docproc.engine.spec.policy import AdaptiveK, StepRecord, best_k, expected_tokens
from docproc.engine.spec.rejection import accept_greedy, accept_sampled


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def test_greedy_acceptance_is_the_longest_matching_prefix_plus_the_target_token():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([3, 7, 1, 4]):
        logits[i, t] = 5.0
    assert accept_greedy(logits.argmax(-1).tolist(), [3, 7, 2]) == ([3, 7, 1], 2)
    assert accept_greedy(logits.argmax(-1).tolist(), [3, 7, 1]) == ([3, 7, 1, 4], 3)  # all accepted: bonus token
    assert accept_greedy(logits.argmax(-1).tolist(), [9, 7, 1]) == ([3], 0)


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_distribution_chi_square():
    """20k draws of the first emitted token with a deliberately bad draft: the output distribution
    must be the target's p, not the draft's q."""
    g = torch.Generator().manual_seed(0)
    vocab = 8
    p = torch.softmax(torch.randn(3, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, -1)
    counts = torch.zeros(vocab, dtype=torch.float64)
    second = torch.zeros(vocab, dtype=torch.float64)
    n = 20000
    for _ in range(n):
        drafts = [int(torch.multinomial(q[0], 1, generator=g)), int(torch.multinomial(q[1], 1, generator=g))]
        out, acc = accept_sampled(p, q, drafts, g)
        counts[out[0]] += 1
        if acc >= 1:  # the second token, given the first draft was accepted, must follow p[1]
            second[out[1]] += 1
    assert chi_square_p(counts, p[0].double() * n) > 0.01
    assert chi_square_p(second, p[1].double() * second.sum()) > 0.01
    # and a draft equal to the target is always accepted
    out, acc = accept_sampled(p, p[:2], [1, 2], g)
    assert acc == 2 and out[:2] == [1, 2] and len(out) == 3


def test_sampled_acceptance_is_reproducible_with_a_seed():
    p = torch.softmax(torch.randn(4, 16), -1)
    q = torch.softmax(torch.randn(3, 16), -1)
    runs = [accept_sampled(p, q, [1, 2, 3], torch.Generator().manual_seed(5)) for _ in range(2)]
    assert runs[0] == runs[1]


def test_expected_tokens_and_best_k():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert best_k(0.9, 0.05, 8) >= 5  # cheap, accurate draft: long windows
    assert best_k(0.1, 0.3, 8) == 0  # acceptance collapse: bypass
    assert best_k(0.8, 1.0, 8) == 0  # a draft as costly as the target never pays


def test_adaptive_k_bypasses_and_reprobes():
    pol = AdaptiveK(k_max=6, fixed=False, prior=0.7, probe_every=4)
    pol.cost_ratio = 0.1
    assert pol.choose(1) > 0
    for _ in range(20):
        pol.observe(1, 4, 0)  # nothing accepted
    picks = []
    for _ in range(4 + 8 + 16):
        picks.append(pol.choose(1))
        if picks[-1]:
            pol.observe(1, picks[-1], 0)  # the probe confirms the collapse
    # bypass, re-probing after 4 steps, then after 8, then 16: the probes' cost shrinks
    assert [i for i, k in enumerate(picks) if k] == [3, 11, 27] and set(picks) == {0, 1}
    for _ in range(30):
        pol.observe(1, 1, 1)  # acceptance recovered
    assert pol.choose(1) > 0
    assert AdaptiveK(k_max=3, fixed=True).choose(7) == 3


def test_adaptive_k_is_one_choice_per_step_priced_by_measured_forwards():
    """The draft's K forwards are paid by the whole step, so the batch gets one K. A draft forward
    as slow as the target's step (launch-bound tiny models on a GPU) never pays at modest
    acceptance; a cheap one does; new sequences start from the average acceptance seen so far."""
    slow, cheap = AdaptiveK(k_max=8, fixed=False, prior=0.7), AdaptiveK(k_max=8, fixed=False, prior=0.7)
    for pol, draft_s in ((slow, 0.010), (cheap, 0.001)):
        pol.batch = 16
        for n in (16, 32, 48, 64, 80, 96):
            pol.observe_step(n, 0.010)  # flat: verified positions cost nothing extra
            pol.observe_draft_forward(16, draft_s)
    assert abs(slow.cost_ratio - 1.0) < 1e-9 and abs(cheap.cost_ratio - 0.1) < 1e-9
    assert slow.verify_cost < 1e-9
    ids = list(range(16))
    assert slow.choose_step(ids) == 0  # 1 + K forwards for E(0.7, K) < 1 + K tokens
    assert cheap.choose_step(ids) >= 3
    for s in ids:  # the sequences stop accepting: the batch stops drafting
        for _ in range(10):
            cheap.observe(s, 4, 0)
    assert cheap.choose_step(ids) == 0
    assert cheap.choose_step([99]) == 0  # a new sequence starts from the low running average


def test_the_step_choice_fast_path_agrees_with_scoring_every_k():
    """choose_step skips scoring every K for every sequence when the cost per draft position is at
    least the highest acceptance (then no K pays for anyone): its choice must be the full one."""
    import random

    from docproc.engine.spec.policy import best_step_k

    rng = random.Random(5)
    for trial in range(300):
        pol = AdaptiveK(k_max=8, fixed=False, prior=rng.uniform(0.1, 0.95), probe_every=10 ** 9)
        pol.batch = rng.randint(1, 16)
        draft_s = rng.uniform(0.001, 0.012)
        for n in (1, 2, 3, 4):
            pol.observe_step(n * pol.batch, 0.010 + rng.uniform(0, 0.002) * n)
            pol.observe_draft_forward(pol.batch, draft_s)
        ids = list(range(pol.batch))
        for s in ids:
            for _ in range(rng.randint(0, 5)):
                k = rng.randint(1, 8)
                pol.observe(s, k, rng.randint(0, k))
        if trial % 3 == 0:
            pol.forget(ids[0])
        per_k = pol.cost_ratio + pol.verify_cost
        full = best_step_k([pol._acc.get(s, pol._global) for s in ids], per_k, 8)
        assert pol.choose_step(ids) == full, (trial, per_k)


def test_a_draft_that_cannot_pay_at_any_acceptance_is_probed_rarely():
    """c + r >= 1 (measured): even all-accepted drafts cannot beat plain decoding, so the policy
    goes straight to the longest probe interval (each probe costs the draft a catch-up prefill);
    a draft that could pay at a better acceptance keeps probing every 16 steps, doubling."""
    hopeless, hopeful = AdaptiveK(k_max=4, fixed=False, prior=0.7), AdaptiveK(k_max=4, fixed=False, prior=0.7)
    for pol, draft_s in ((hopeless, 0.011), (hopeful, 0.004)):
        for n in (1, 2, 3, 4):  # (a line needs four points)
            pol.observe_step(n, 0.010)
            pol.observe_draft_forward(1, draft_s)
        for _ in range(30):
            pol.observe(1, 4, 0)
    assert hopeless.costs_measured and hopeless.cost_ratio > 1 and hopeful.cost_ratio < 1
    probes = {name: [i for i in range(4000) if pol.choose(1)] for name, pol in (("hopeless", hopeless),
                                                                               ("hopeful", hopeful))}
    # hopeless: from 256 steps, doubling without bound (a run's probes cost ~nothing over it)
    assert probes["hopeless"] == [255, 767, 1791, 3839]
    # hopeful: from 16, doubling up to 256 (acceptance may recover)
    assert probes["hopeful"][:3] == [15, 47, 111]
    assert {b - a for a, b in zip(probes["hopeful"][5:], probes["hopeful"][6:])} == {256}


def test_probes_are_spaced_so_that_they_cost_at_most_one_percent_of_the_bypassed_steps():
    """A probe step's measured time over a plain step's (the draft's catch-up, its forward, the
    wider verify) sets the least interval between probes: at 10 ms a step, a probe 20 ms dearer
    comes at most once in 200 steps (the budget is 1%). The median of the last five probes is
    used, so one slow probe (a page faulted in) weighs little."""
    def run(extra_of_probe):
        pol = AdaptiveK(k_max=4, fixed=False, prior=0.7, probe_every=16)
        for n in (1, 2, 3, 4):
            pol.observe_step(n, 0.010)
            pol.observe_draft_forward(1, 0.004)  # c = 0.4: the draft could pay at a good acceptance
        for _ in range(30):
            pol.observe(1, 4, 0)  # but nothing is accepted: bypassed, probing
        probes = []
        for i in range(2000):
            if pol.choose(1):
                probes.append(i)
                pol.observe(1, 1, 0)  # the probe confirms the collapse
                pol.observe_probe(0.010 + extra_of_probe(len(probes)))
        return [b - a for a, b in zip(probes, probes[1:])], probes[0]

    gaps, first = run(lambda n: 0.020 if n != 3 else 2.0)
    assert first == 15  # unmeasured: the usual first interval
    # 32, 64 and 128 would be due, the 1% budget asks 200; then the doubling's cap, 256
    assert gaps[:6] == [200, 200, 200, 256, 256, 256]
    gaps, _ = run(lambda n: 0.001)  # cheap probes: the doubling from 16 alone
    assert gaps[:5] == [32, 64, 128, 256, 256]


def test_adaptive_k_prices_verified_positions_from_measured_steps():
    """Where a target step's time grows with its tokens (a CPU), verifying K more positions
    costs about K more steps and the draft stops paying; where it hardly grows (a GPU at small
    batch), the same acceptance picks long windows."""
    assert best_k(0.8, 0.2, 8, r=0.0) >= 3
    assert best_k(0.8, 0.2, 8, r=1.0) == 0
    compute_bound = AdaptiveK(k_max=8, fixed=False, prior=0.8)
    memory_bound = AdaptiveK(k_max=8, fixed=False, prior=0.8)
    for pol in (compute_bound, memory_bound):
        pol.cost_ratio = 0.2
        pol.batch = 16
    assert compute_bound.verify_cost == 0.0 and compute_bound.choose(1) >= 3  # nothing measured yet
    for n in range(16, 200, 8):
        compute_bound.observe_step(n, 0.001 + 0.002 * n)  # 2 ms per token, 1 ms fixed
        memory_bound.observe_step(n, 0.020 + 0.00001 * n)  # 20 ms fixed, 10 us per token
    assert compute_bound.verify_cost > 0.9 and compute_bound.choose(1) == 0
    assert memory_bound.verify_cost < 0.01 and memory_bound.choose(2) >= 3


def test_the_drafts_catch_up_prefill_must_be_repaid_by_the_expected_saving():
    """A sequence drafts only if its expected saving over its remaining tokens repays the draft's
    catch-up forward (a new page: its whole prompt), that cost shared by the queries of the page."""
    pol = AdaptiveK(k_max=4, fixed=False, prior=0.8)
    assert pol.worth_catching_up(1, 4, 1300, 1, 0) is None  # unmeasured: the engine lets one page go
    for n in (1, 2, 3, 4):
        pol.observe_step(n, 0.010)  # a 10 ms decode step, flat in tokens (r = 0)
        pol.observe_draft_forward(1, 0.002)  # c = 0.2
    pol.observe_draft_prefill(1000, 0.1)  # one catch-up timed: priced proportionally until four are
    assert pol.worth_catching_up(1, 4, 1300, 1, generated=0) is not None
    for n in (100, 400, 800, 1300):
        pol.observe_draft_prefill(n, 0.0001 * n)  # 0.1 ms per token: a page costs 130 ms
    # gain at K = 4, a = 0.8: E = 3.36 over 1.8 step units = 1.87; saving 4.6 ms per remaining token
    assert pol.worth_catching_up(1, 4, 1300, 1, generated=0)  # 32 tokens to go (the prior): 149 ms
    assert not pol.worth_catching_up(1, 4, 1300, 1, generated=20)  # 12 to go: 56 ms < 130 ms
    assert pol.worth_catching_up(1, 4, 1300, 7, generated=20)  # seven queries of the page share it
    assert pol.worth_catching_up(1, 4, 2, 1, generated=31)  # decode-sized catch-ups always go
    # max_tokens bounds the remainder: 5 tokens left cannot repay the page
    assert not pol.worth_catching_up(1, 4, 1300, 1, generated=0, left=5)
    for _ in range(30):
        pol.observe_finished(4)  # short answers: the expected remainder shrinks
    assert not pol.worth_catching_up(1, 4, 1300, 1, generated=0)
    assert not pol.worth_catching_up(1, 4, 1300, 1, generated=0, left=100)
    # ...unless the sequence cannot stop before max_tokens (EOS ignored, no stop strings)
    assert pol.worth_catching_up(1, 4, 1300, 1, generated=0, left=100, exact=True)
    pol.probing = True  # a probe's cost is bounded by the probe interval instead
    assert pol.worth_catching_up(1, 4, 1300, 1, generated=0)
    assert AdaptiveK(k_max=4, fixed=True).worth_catching_up(1, 4, 10 ** 6, 1, 0)


def test_catch_up_pricing_falls_back_on_all_target_steps_before_a_pure_decode_step_is_timed():
    """In a pipeline run the first steps mix prefill chunks with decodes, all about 8k tokens:
    until a pure decode step is timed, a catch-up is priced from those steps per token (a fitted
    line would sit flat at their mean, seconds, and call a decode step as costly as a prefill).
    On a CPU that is right: verifying K more positions costs about K steps, and a page's prefill
    for the draft does not pay. On a GPU it is conservative until decode steps are timed."""
    cpu = AdaptiveK(k_max=4, fixed=False, prior=0.8)
    gpu = AdaptiveK(k_max=4, fixed=False, prior=0.8)
    for n in (8000, 8100, 8150, 8192):
        cpu.observe_any_step(n, 2.2)  # ~0.27 ms per token
        cpu.observe_draft_prefill(n, 0.4)
        gpu.observe_any_step(n, 0.100)
        gpu.observe_draft_prefill(n, 0.02)
    cpu.batch = gpu.batch = 50
    assert not cpu.worth_catching_up(1, 4, 1300, 7, generated=0)
    assert not gpu.worth_catching_up(1, 4, 1300, 7, generated=0)  # conservative: priced like the CPU
    for n in (50, 100, 150, 200):
        gpu.observe_step(n, 0.008 + 0.000001 * n)  # decode/verify: an 8 ms floor, tokens nearly free
        gpu.observe_draft_forward(50, 0.002)
    gpu.batch = 7  # the seven queries of one page decoding: each has a seventh of an 8 ms step
    assert gpu.worth_catching_up(1, 4, 1300, 7, generated=0)


def test_a_compiling_first_catch_up_does_not_price_later_ones_out():
    """Before four catch-ups are timed their cost is proportional to tokens at the cheapest rate
    seen: a first forward that compiled kernels (seconds) must not make every page look dear."""
    pol = AdaptiveK(k_max=4, fixed=False, prior=0.8)
    for n in (1, 2, 3, 4):
        pol.observe_step(n, 0.010)
        pol.observe_draft_forward(1, 0.002)
    pol.observe_draft_prefill(1300, 3.0)  # compiled on the way
    assert not pol.worth_catching_up(1, 4, 1300, 1, generated=0, left=128, exact=True)
    pol.observe_draft_prefill(1300, 0.02)  # the same page size, warm: 20 ms
    assert pol.worth_catching_up(1, 4, 1300, 1, generated=0, left=128, exact=True)


def test_overlapped_plain_steps_raise_the_bar_for_drafting():
    """Bypassed steps that overlap cost less than the target's line (fitted to steps with the host's
    work in them): the policy compares drafting with what plain decoding really costs. A draft
    that pays against the line's plain step (c = 0.3, a = 0.7: E(0.7, 2)/(1 + 2 x 0.3) = 1.37)
    stops paying when plain steps take half the line's time, and pays again at a = 0.95."""
    from docproc.engine.spec.policy import best_step_k

    assert best_step_k([0.7], 0.3, 4) > 0 and best_step_k([0.7], 0.3, 4, plain=0.5) == 0
    assert best_step_k([0.95], 0.3, 4, plain=0.5) > 0
    pol = AdaptiveK(k_max=4, fixed=False, prior=0.7)
    for n in (1, 2, 3, 5):
        pol.observe_step(n, 0.010)
        pol.observe_draft_forward(1, 0.003)
    assert pol.overlap_ratio == 1.0 and pol.choose_step([1]) > 0
    for _ in range(9):
        pol.observe_overlapped_step(1, 0.005)
    assert abs(pol.overlap_ratio - 0.5) < 1e-9
    assert pol.choose_step([1]) == 0
    pol.observe_draft_prefill(100, 0.004)
    assert pol.worth_catching_up(1, 2, tokens=100, share=1, generated=0, left=50) is False
    for _ in range(10):
        pol.observe(1, 4, 4)  # this sequence accepts everything
    assert pol.choose_step([1]) > 0


def test_a_step_record_feeds_each_line_only_what_its_step_measured():
    """AdaptiveK.record, the engine's one entry: a decode step's time feeds the target's lines, a
    prefill chunk only the any-step line, a step that captured a graph nothing, an overlapped
    step only the overlap ratio; draft forwards, verifications and a probe go to theirs; a
    sequence that ended is forgotten (its verification in the same step included) and its length
    kept, unless it failed."""
    pol = AdaptiveK(4, fixed=False)
    pol.record(StepRecord(500, 0.5))  # a prefill chunk: the any-step line only
    assert pol._any_step.points[-1] == (500, 0.5) and not pol._target.points
    for n in (1, 2, 3, 4):
        pol.record(StepRecord(n, 0.010, decode_only=True))
    assert pol._target.fit is not None and pol._target.at(3) == pytest.approx(0.010)
    v = pol._target.version
    pol.record(StepRecord(4, 9.0, timed=False, decode_only=True))  # captured a graph
    assert pol._target.version == v
    pol.record(StepRecord(4, 0.005, decode_only=True, overlapped=True))
    assert pol._target.version == v and pol.overlap_ratio == pytest.approx(0.5)
    pol.record(StepRecord(8, 0.011, decode_only=True, draft_decodes=[(4, 0.002)] * 2,
                          draft_catch_ups=[(1300, 0.05)], verified=[(7, 4, 4), (8, 4, 0)],
                          ended=[(7, 40), (9, None)]))
    assert [p[0] for p in pol._draft.points] == [4, 4] and pol._draft_prefill.points[-1] == (1300, 0.05)
    assert 7 not in pol._acc and 8 in pol._acc and pol._observations == 2  # 7 ended: forgotten
    assert pol._generated == pytest.approx(0.9 * 32.0 + 0.1 * 40)  # 9 failed: its length not counted
    pol.record(StepRecord(8, 0.011, decode_only=True, probe_seconds=0.021))
    assert pol._probe_extra[-1] == pytest.approx(0.021 - pol._target.at(pol.batch))


def test_acceptance_is_estimated_per_position_as_E_a_K_assumes():
    """Drafts each accepted with chance 0.9 once those before were, K = 4: the policy's a is 0.9
    (accepted over tried positions), not the 0.77 share of drafts kept, so E(a, 4) is 4.1."""
    import random

    rng = random.Random(5)
    pol = AdaptiveK(k_max=4, fixed=False, prior=0.5)
    for _ in range(3000):
        accepted = 0
        while accepted < 4 and rng.random() < 0.9:
            accepted += 1
        pol.observe(1, 4, accepted)
    assert abs(pol._global - 0.9) < 0.025 and abs(pol._acc[1] - 0.9) < 0.12  # (per sequence: ~5 steps remembered)
    assert abs(expected_tokens(pol._global, 4) - 4.1) < 0.15


def test_reset_acceptance_keeps_the_costs_and_returns_to_the_prior():
    pol = AdaptiveK(k_max=4, fixed=False, prior=0.7)
    for n in (1, 2, 3, 5):
        pol.observe_step(n, 0.010)
        pol.observe_draft_forward(1, 0.002)
    for _ in range(20):
        pol.observe(1, 4, 0)
    assert pol.choose_step([1]) == 0 and pol._global < 0.3
    c = pol.cost_ratio
    pol.reset_acceptance()
    assert pol._global == 0.7 and not pol._acc and pol.cost_ratio == c
    assert pol.choose_step([1]) > 0  # the prior pays at c = 0.2


def test_the_policy_state_reports_its_beliefs_and_reset_restores_the_prior():
    """state() is what spec_info()["policy"] and bench_engine part c report: the measured costs,
    the acceptance new sequences are scored with, the probe spacing and the catch-up's price."""
    pol = AdaptiveK(k_max=4, fixed=False, prior=0.7, probe_every=16)
    st = pol.state()
    assert st["per_k"] is None and st["target_step_s"] is None and st["catch_up_s"] is None
    assert st["acceptance_global"] == 0.7 and st["probe_interval"] == 16 and not st["fixed"]
    pol.batch = 1
    for n in (1, 2, 3, 4, 5):
        pol.observe_step(n, 0.004 + 0.0001 * (n - 1))  # 4 ms a step, 0.1 ms per verified position
        pol.observe_draft_forward(1, 0.0012)
    for t in (500, 1000, 1500):
        pol.observe_draft_prefill(t, 0.00001 * t)  # 10 us a token
    pol.choose_step([1])
    st = pol.state(catch_up_tokens=1300)
    assert abs(st["target_step_s"] - 0.004) < 1e-6
    assert abs(st["per_k"] - (0.0012 + 0.0001) / 0.004) < 1e-3  # c + r = 0.3 + 0.025
    assert abs(st["catch_up_s"] - 0.013) < 1e-6 and st["catch_up_tokens"] == 1300
    for _ in range(20):
        pol.observe(1, 4, 0)  # nothing accepted
    low = pol.state()
    assert low["acceptance_global"] < 0.7 and low["acceptance_hi"] < 0.7 and low["sequences_scored"] == 1
    pol.reset_acceptance()
    back = pol.state()
    assert back["acceptance_global"] == 0.7 and back["sequences_scored"] == 0 and back["probe_interval"] == 16
    assert back["target_step_s"] == st["target_step_s"]  # the costs are kept


def test_a_request_explores_a_catch_up_that_only_the_unobserved_prior_rules_out():
    """Before any verification the acceptance scored is only the prior. Where the prior's expected
    saving misses the catch-up's price but the best case (every draft accepted) repays it, the
    answer is None (the engine lets one page go, as while costs are unmeasured), so a prior that
    barely fails cannot keep a good draft out for good. Once verifications are seen, the priced
    answer stands; reset_acceptance() makes the prior a guess again."""
    pol = AdaptiveK(k_max=4, fixed=False, prior=0.7)
    for n in (1, 2, 3, 4, 5):
        pol.observe_step(n, 0.0043)  # a 4.3 ms step, flat in tokens (r = 0)
        pol.observe_draft_forward(1, 0.38 * 0.0043)  # c = 0.38 (bench_engine part c, 7B / 2B)
    for _ in range(4):
        pol.observe_overlapped_step(1, 0.88 * 0.0043)  # overlap ratio 0.88
    for n in (400, 800, 1200, 1600):
        pol.observe_draft_prefill(n, 0.08 * n / 1300)  # a 1,300-token page: 80 ms
    ask = dict(k=2, tokens=1300, share=1, generated=0, left=128, exact=True)
    # the prior: gain 0.88 E(0.7, 2) / 1.76 = 1.10, 128 x 4.3 ms x 0.09 = 48 ms < 80 ms; all
    # accepted: gain 1.5, 183 ms >= 80 ms
    assert pol.worth_catching_up(1, **ask) is None
    assert pol.worth_catching_up(1, **{**ask, "tokens": 8000}) is False  # not even the best case repays
    pol.observe(1, 2, 2)  # the explored sequence's first verification: both drafts accepted
    assert pol.worth_catching_up(1, **ask) is True  # its own estimate (0.8) repays the catch-up
    assert pol.worth_catching_up(2, **ask) is False  # a new one is priced at the global estimate (0.73)
    pol.reset_acceptance()
    assert pol.worth_catching_up(2, **ask) is None


def test_batched_acceptance_equals_each_window_alone():
    """accept_sampled_batch reads every window in one transfer; with a generator per window each
    result is the one that window gets alone, windows of different k side by side."""
    from docproc.engine.spec.rejection import Window, accept_sampled_batch

    g = torch.Generator().manual_seed(1)
    shapes = [(3, 12), (1, 12), (5, 12)]
    ps = [torch.softmax(torch.randn(k + 1, v, generator=g) * 2, -1) for k, v in shapes]
    qs = [torch.softmax(torch.randn(k, v, generator=g) * 2, -1) for k, v in shapes]
    drafts = [torch.multinomial(q, 1, generator=g).view(-1).tolist() for q in qs]
    for seed in range(20):
        batch = accept_sampled_batch([Window(p, q, d, torch.Generator().manual_seed(seed + i))
                                      for i, (p, q, d) in enumerate(zip(ps, qs, drafts))])
        alone = [accept_sampled(p, q, d, torch.Generator().manual_seed(seed + i))
                 for i, (p, q, d) in enumerate(zip(ps, qs, drafts))]
        assert batch == alone
        for (out, acc), d in zip(batch, drafts):
            assert len(out) == acc + 1 and out[:acc] == d[:acc]

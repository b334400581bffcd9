"""Chapter 16 checkers: the acceptance rule (contract, distribution, named mistakes) and the rule inside
engine.LLM's verify rows. The reference rule and a rule that draws its own randomness pass; each
classic mistake gets its named verdict; unfinished work is reported as not attempted."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.exercises import accepts, not_attempted, rejects

from engine.exercises import ch16
from engine.runtime.speculative import accept_reference


def own_randomness(p, q, draft, u_accept, u_resample):
    """Right in distribution, but it ignores the uniforms it is given (a seeded generator of its own)."""
    rng = np.random.default_rng(int(u_accept[0] * 2**32))
    out = []
    for j, d in enumerate(draft):
        if rng.random() * q[j, d] < p[j, d]:
            out.append(d)
            continue
        residual = np.maximum(p[j] - q[j], 0.0)
        return out + [int(rng.choice(len(residual), p=residual / residual.sum()))]
    return out + [int(rng.choice(p.shape[1], p=p[len(draft)]))]


def keep_everything(p, q, draft, u_accept, u_resample):
    return list(draft) + [int(np.argmax(p[len(draft)]))]


def guesses_after_a_rejection(p, q, draft, u_accept, u_resample):
    """Emits a token for a rejected guess and then goes on with the next guesses."""
    out = accept_reference(p, q, draft, u_accept, u_resample)
    return out + list(draft[len(out):])


def returns_a_string(p, q, draft, u_accept, u_resample):
    return "1 2"


def test_the_reference_rule_and_a_rule_with_its_own_randomness_pass(capsys):
    accepts(ch16.check_acceptance_rule, accept_reference, capsys)
    accepts(ch16.check_acceptance_rule, own_randomness, capsys)


@pytest.mark.parametrize("fn, hint", [
    (ch16.argmax_rule, "accepting by argmax"),
    (ch16.no_residual_rule, "forgetting the residual"),
    (ch16.ignore_q_rule, "accepting with probability p(d), ignoring q"),
    (ch16.no_bonus_rule, "not emitting the bonus token when all guesses are accepted"),
    (ch16.flipped_rule, "u compared the wrong way"),
])
def test_each_classic_mistake_is_named(fn, hint, capsys):
    rejects(ch16.check_acceptance_rule, fn, capsys, hint)


@pytest.mark.parametrize("fn, hint", [
    (keep_everything, "the model's probability is 0"),
    (guesses_after_a_rejection, "then emits one token and stops"),
    (returns_a_string, "return a list of token ids"),
])
def test_a_broken_contract_is_named(fn, hint, capsys):
    rejects(ch16.check_acceptance_rule, fn, capsys, hint)


def test_ignoring_q_is_right_for_a_one_hot_q_and_only_a_general_q_catches_it(capsys):
    """The mistake is caught by the cases whose q is not one-hot, not before."""
    assert ch16.check_acceptance_rule(ch16.ignore_q_rule) is False
    assert "a q that is not one-hot" in capsys.readouterr().out
    p, q, draft = ch16.statistical_cases()[0][1:]
    rng = np.random.default_rng(3)
    for _ in range(200):
        ua, ur = rng.random(4), rng.random(4)
        assert ch16.ignore_q_rule(p, q, draft, ua, ur) == accept_reference(p, q, draft, ua, ur)


def test_the_verdict_is_deterministic_and_fast(capsys):
    import time
    start = time.perf_counter()
    ch16.check_acceptance_rule(accept_reference)
    first = capsys.readouterr().out
    assert time.perf_counter() - start < 10
    ch16.check_acceptance_rule(accept_reference)
    assert capsys.readouterr().out == first


def test_not_attempted(capsys):
    assert ch16.check_acceptance_rule(not_attempted) is False
    assert "not attempted yet" in capsys.readouterr().out
    assert ch16.check_rule_in_engine(not_attempted) is False
    assert "not attempted yet" in capsys.readouterr().out


def test_the_reference_rule_runs_inside_the_engine(capsys):
    assert ch16.check_rule_in_engine(accept_reference) is True
    out = capsys.readouterr().out
    assert out.startswith("[OK]") and "the same tokens as the engine's rule" in out, out


def test_a_rule_with_its_own_randomness_passes_in_the_engine_and_is_told_so(capsys):
    assert ch16.check_rule_in_engine(own_randomness) is True
    assert "draws differently" in capsys.readouterr().out


@pytest.mark.parametrize("fn, hint", [(keep_everything, "without speculation (they part at token"),
                                      (ch16.flipped_rule, "without speculation (they part at token")])
def test_a_wrong_greedy_rule_fails_in_the_engine(fn, hint, capsys):
    rejects(ch16.check_rule_in_engine, fn, capsys, hint)


def test_the_cost_model():
    assert ch16.expected_tokens(0.0, 4) == 1 and ch16.expected_tokens(1.0, 4) == 5
    assert ch16.expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert ch16.speedup(0.8, 4, c=0.0) == pytest.approx(ch16.expected_tokens(0.8, 4))
    assert ch16.speedup(0.0, 8, c=0.1) < 1 < ch16.speedup(0.9, 4, c=0.05)
